"""Benchmarks and the simulated vLLM engine: `sim` (the engine), `harness` (what the tests
and the suites share), `suites` (the measurements); bench/README.md."""
