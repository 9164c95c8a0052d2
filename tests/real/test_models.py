"""The tiny models are built deterministically: two builds are byte-identical, file by file."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from bench.harness.realvllm.home import Home
from bench.harness.realvllm.models import ALL, ROUTING, files
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
    # And the models the tier serves are this build (the folder may also hold the big
    # ones the routing suite builds).
    served = digests(real_home.models)
    assert {path: digest for path, digest in served.items() if path.split("/")[0] in ALL} == first


def test_routing_models_build_deterministically(real_home: Home, tmp_path: Path) -> None:
    """llama-big, qwen2vl-big, llama-small and qwen2vl-small (the real-engine routing
    suite's): two builds are byte-identical, and of the sizes documented (47.7M, 51.8M,
    2.6M and 2.8M float32 parameters)."""
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        command = [str(real_home.python), "-m", "bench.harness.realvllm.models", str(out)]
        done = subprocess.run(
            [*command, "--only", ",".join(ROUTING)], cwd=ROOT, capture_output=True, timeout=300
        )
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    first = digests(outs[0])
    assert first == digests(outs[1])
    assert {path.split("/")[0] for path in first} == set(ROUTING)
    weights = [(outs[0] / name / "model.safetensors").stat().st_size / 4e6 for name in ROUTING]
    assert [round(w, 1) for w in weights] == [47.7, 51.8, 2.6, 2.8]
