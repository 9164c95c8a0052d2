"""The README's first command (`python -m bench.demo`) runs end to end and shows what it
claims: allowed requests answered, refusals with their codes, conversations kept on
one engine."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.procs import ROOT


def test_demo_runs_and_shows_each_outcome() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.search(r"POST /v1/chat/completions\s+-> 200 ", out)
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
