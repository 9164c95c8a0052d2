"""The README's first run, run as written: an engine, the gateway, one request with curl
and one with the `openai` client. Only the ports (free ones, not 8001 and 8080, which
another run may hold) and the `.venv` (this interpreter's) are substituted; the setup
line is skipped (the tests run inside the environment it makes)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT, clean_env, free_port


def first_run_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running it", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


@pytest.mark.slow
def test_the_readme_first_run_works_as_written() -> None:
    block = first_run_block()
    lines = [line for line in block.splitlines() if not line.startswith("bash scripts/setup.sh")]
    script = "\n".join(lines)
    assert "8001" in script and "8080" in script and ".venv/bin/" in script
    engine, gateway = free_port(), free_port()
    script = script.replace("8001", str(engine)).replace("8080", str(gateway))
    script = script.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    # This checkout's code, whichever checkout the interpreter was installed from.
    env = clean_env({"PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        # The script stops its engine and gateway; if it failed before, they go here.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    # The gateway logs to the same terminal: the replies are found among its lines.
    (curl_reply,) = [line for line in lines if '"object":"chat.completion"' in line]
    assert '"role":"assistant"' in curl_reply
    (client_reply,) = [line for line in lines if line.startswith("openai client:")]
    assert client_reply.removeprefix("openai client:").strip()
    assert "Traceback" not in err


def test_the_cost_section_is_a_link_to_the_latest_table() -> None:
    """The README gives no figure of its own: one sentence pointing at bench/README.md's
    latest table, which names each run's date and command and gives ratios to a baseline
    measured in the same run."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What it costs\n", 1)[1].split("\n## ", 1)[0].strip()
    assert section.count(". ") == 0 and section.endswith(".")
    assert "(bench/README.md#latest-table)" in section
    assert not re.search(r"\d", section.replace("bench/README.md#latest-table", ""))
    bench = (ROOT / "bench" / "README.md").read_text()
    table = bench.split("### Latest table\n", 1)[1].split("\n### ", 1)[0]
    assert re.findall(r"\*\*\d{4}-\d\d-\d\d \d\d:\d\d-\d\d:\d\d\*\*", table)
    assert table.count("`python -m bench overhead") >= 1
    header = next(line for line in table.splitlines() if line.startswith("| figure |"))
    assert all(" / " in column for column in header.strip("|").split("|")[1:])
