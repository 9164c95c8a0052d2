"""A simulated vLLM engine: vLLM's wire format, prefix cache, media fetching and load.

Run it with `python -m bench.sim --port 8001`; see docs/sim.md for what it models.
"""
