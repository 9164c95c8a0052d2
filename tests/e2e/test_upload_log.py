"""The gateway's output stays JSON lines when uploads are malformed: python-multipart's own
logger (plain-text warnings about boundaries and headers) is kept quiet by
`configure_logging`, and the refusal is the gateway's request line. A gateway under
uvicorn in front of a simulated engine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import Proc, gateway_proc, running, sim_proc, sim_received, wait_for

KEY = "key-upload-log-0123456789abcdef"
# Bodies the multipart parser refuses part-way, each after logging a warning of its own.
MALFORMED = [
    # The body's first boundary is not the one the Content-Type names.
    b"--aaa\r\n\r\n",
    # A header line without a colon.
    b"--xYz\r\nContent-Disposition form-data\r\n\r\nx\r\n--xYz--\r\n",
    # A bad character after the boundary.
    b"--xYz!\r\n\r\n",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("upload-log")
    sim = sim_proc(tmp, "--latency", "zero")
    with running(sim):
        env = {"GATEWAY_ENGINES": json.dumps([sim.url]), "GATEWAY_API_KEYS": json.dumps([KEY])}
        gateway = gateway_proc(tmp, env)
        with running(gateway, ready_path="/healthz"):
            assert wait_for(lambda: httpx.get(gateway.url + "/readyz").status_code == 200)
            yield sim, gateway


@pytest.mark.slow
def test_malformed_uploads_leave_only_json_lines(stack: tuple[Proc, Proc]) -> None:
    sim, gateway = stack
    before = sim_received(sim.url)
    headers = {
        "Authorization": f"Bearer {KEY}",
        "Content-Type": "multipart/form-data; boundary=xYz",
    }
    for body in MALFORMED:
        r = httpx.post(gateway.url + "/v1/audio/transcriptions", content=body, headers=headers)
        assert r.status_code == 400, body
        assert r.json()["error"]["code"] == "invalid_request", body
    assert sim_received(sim.url) == before

    def refusals() -> int:
        return gateway.log().count('"code":"invalid_request"')

    # Every refusal's request line is written: whatever the parser logged is in by then.
    assert wait_for(lambda: refusals() == len(MALFORMED))
    lines = [line for line in gateway.log().splitlines() if line.strip()]
    assert lines
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not_json == []
