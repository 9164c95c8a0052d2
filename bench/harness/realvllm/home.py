"""Where the engine venv, the models and the engines' run files live.

`$VLLM_CPU_HOME`, by default `~/.cache/vllm-gateway/vllm-cpu`: outside the repository, so
a fresh clone reuses an engine installed before and a re-run is quick.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def default(cls) -> Home:
        configured = os.environ.get("VLLM_CPU_HOME")
        root = Path(configured) if configured else Path.home() / ".cache/vllm-gateway/vllm-cpu"
        return cls(root.expanduser())

    @property
    def python(self) -> Path:
        """The engine venv's interpreter (created by scripts/vllm-cpu.sh)."""
        return self.root / "venv" / "bin" / "python"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def run(self) -> Path:
        """Engines' temp files, caches and ipc sockets, each engine in a folder below."""
        return self.root / "run"

    def model(self, name: str) -> Path:
        return self.models / name

    def installed(self) -> bool:
        return self.python.exists()
