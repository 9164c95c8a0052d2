"""The README's first command (`python -m bench.demo`) runs end to end and shows what it
claims: allowed requests answered, refusals with their codes, conversations kept on
one engine; whole words of the simulated engine's reply; nothing left in the temporary
directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT

# The simulated engine's canned reply (bench/sim/generate.py), word by word.
WORDS = {"The", "simulated", "engine", "answers", "with", "deterministic", "text;", "no"}
WORDS |= {"model", "ran."}


@pytest.mark.slow
def test_demo_runs_and_shows_each_outcome(tmp_path: Path) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.demo"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(temp)},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    reply = re.search(r"POST /v1/chat/completions\s+-> 200 '(.+)'", out)
    assert reply is not None, out
    streamed = re.search(r"words as they arrive:\s+-> (.+)", out)
    assert streamed is not None, out
    for text in (reply[1], streamed[1]):
        assert text.split() and set(text.split()) <= WORDS, text
    assert re.search(r"data: image .*-> 200 prompt_tokens=\d+", out)
    expected = [
        ("without a key", "401 invalid_api_key"),
        ("runtime LoRA loading", "403 endpoint_blocked"),
        ('model "../x"', "404 model_not_found"),
        ("cloud metadata address", "400 media_url_not_allowed"),
        ("file:///etc/passwd", "400 media_url_not_allowed"),
        ("prompt_embeds", "400 field_not_allowed"),
    ]
    for title, verdict in expected:
        line = next(line for line in out.splitlines() if title in line)
        assert line.endswith(verdict), line
    turns = re.findall(r"conv\d: turns served by (.+)", out)
    assert len(turns) == 4
    for served in turns:
        engines = served.split(", ")
        assert len(engines) == 3 and len(set(engines)) == 1, served
    # No key and no prompt text in the log lines the demo prints.
    assert "sk-demo-" not in out
    assert "Conversation 0, turn 0" not in out
    # The logs went to a temporary directory, removed at the end.
    assert "Logs in " + str(temp) in out
    assert list(temp.iterdir()) == []
