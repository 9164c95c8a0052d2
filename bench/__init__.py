"""Benchmarks and the simulated vLLM engine."""
