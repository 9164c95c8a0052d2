"""The measurements: the suites `python -m bench <suite>` runs (overhead, reference,
scale, routing, soak), the stand-alone ones (`python -m bench.suites.instructions`,
`.decode_memory`, `.walk`), and what they share (the fleet of servers a run starts, the
load generators, the report)."""
