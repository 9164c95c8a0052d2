"""The tiny models are built deterministically: two builds are byte-identical, file by file."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from bench.harness.realvllm.home import Home
from bench.harness.realvllm.models import ALL, files
from bench.harness.server import ROOT

pytestmark = pytest.mark.real_vllm


def digests(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files(root)
    }


def test_two_builds_are_byte_identical(real_home: Home, tmp_path: Path) -> None:
    outs = [tmp_path / "first", tmp_path / "second"]
    builds = [
        subprocess.Popen(
            [str(real_home.python), "-m", "bench.harness.realvllm.models", str(out)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for out in outs
    ]
    for build in builds:
        _, err = build.communicate(timeout=120)
        assert build.returncode == 0, err.decode(errors="replace")[-2000:]
    first, second = digests(outs[0]), digests(outs[1])
    assert first == second
    # Every model is there, with weights, config and tokenizer.
    for name in ALL:
        for needed in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"{name}/{needed}" in first
    assert {"tiny-qwen2vl/processor_config.json", "tiny-bert-embed/modules.json"} <= set(first)
    # And the models the tier serves are this build.
    assert digests(real_home.models) == first
