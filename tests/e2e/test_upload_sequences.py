"""A transcription weighs the engine sequences vLLM runs for it: one per clip of the
audio (`media.audio_clip_seconds` each, from the file's headers) times `n` with
`use_beam_search`, read from the multipart form as vLLM's pydantic reads it. Uploads
were weighed as one sequence whatever their form said (form fields `n=256` and
`use_beam_search=true` from a key capped at 1). The gateway under uvicorn in front of a
simulated engine; every refusal: status, code, and nothing reached the engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.e2e.test_media_duration import wav
from tests.procs import (
    Proc,
    auth,
    error_code,
    gateway_proc,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

pytestmark = pytest.mark.slow

ONE = "sk-upseq-one-0123456789abcdef"
EIGHT = "sk-upseq-eight-0123456789abcdef"
PLAIN = "sk-upseq-plain-0123456789abcdef"
CLIP = 1  # seconds per clip: a 4 s file is 4 engine requests


@dataclass
class Stack:
    sim: Proc
    gateway: Proc

    def upload(self, key: str, seconds: int, **form: str) -> httpx.Response:
        audio = wav(8000 * seconds, 8000)
        return HTTP.post(
            self.gateway.url + "/v1/audio/transcriptions",
            headers=auth(key),
            files={"file": ("a.wav", audio, "audio/wav")},
            data={"model": MODEL, **form},
            timeout=20,
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("upload-sequences")
    keys = [
        {"key": ONE, "name": "one", "max_in_flight": 1},
        {"key": EIGHT, "name": "eight", "max_in_flight": 8},
        {"key": PLAIN, "name": "plain"},
    ]
    with running(sim_proc(tmp)) as (sim,):
        env = {
            "GATEWAY_ENGINES": json.dumps([sim.url]),
            "GATEWAY_API_KEYS": json.dumps(keys),
            "GATEWAY_MEDIA__AUDIO_CLIP_SECONDS": str(CLIP),
        }
        gateway = gateway_proc(tmp, env)
        with running(gateway, ready_path="/healthz"):
            assert wait_for(lambda: HTTP.get(gateway.url + "/readyz").status_code == 200)
            yield Stack(sim, gateway)


def refused(resp: httpx.Response) -> tuple[int, str | None, str | None]:
    param = resp.json()["error"].get("param") if resp.status_code >= 400 else None
    return resp.status_code, error_code(resp), param


def test_beam_search_form_fields_count_as_beams(stack: Stack) -> None:
    """n=256 with use_beam_search from a key capped at 1: 400 too_many_sequences naming
    `n`, before the engine; so is n=257 from a key without a cap of its own (over
    limits.max_sequences_per_request); `n` without beam search is one sequence."""
    before = sim_received(stack.sim.url)
    beams = stack.upload(ONE, 1, n="256", use_beam_search="true")
    assert refused(beams) == (400, "too_many_sequences", "n"), beams.text
    assert "256 sequences" in beams.json()["error"]["message"]
    lax = stack.upload(ONE, 1, n="2_56", use_beam_search="On")  # as pydantic reads them
    assert refused(lax) == (400, "too_many_sequences", "n"), lax.text
    over = stack.upload(PLAIN, 1, n="257", use_beam_search="1")
    assert refused(over) == (400, "too_many_sequences", "n"), over.text
    assert sim_received(stack.sim.url) - before == 0
    plain = stack.upload(ONE, 1, n="256", use_beam_search="false")
    assert plain.status_code == 200, plain.text
    assert sim_received(stack.sim.url) - before == 1


def test_every_clip_of_the_audio_counts(stack: Stack) -> None:
    """4 s in 1 s clips: 4 sequences, 8 with n=2 beams, which fits a key capped at 8;
    n=3 (12) does not, nor do 9 s of audio (9 clips) without beams."""
    before = sim_received(stack.sim.url)
    long = stack.upload(EIGHT, 9)
    assert refused(long) == (400, "too_many_sequences", "file"), long.text
    wide = stack.upload(EIGHT, 4, n="3", use_beam_search="true")
    assert refused(wide) == (400, "too_many_sequences", "file"), wide.text
    assert sim_received(stack.sim.url) - before == 0
    fits = stack.upload(EIGHT, 4, n="2", use_beam_search="true")
    assert fits.status_code == 200, fits.text
    assert sim_received(stack.sim.url) - before == 1


def test_an_unreadable_count_is_refused(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    r = stack.upload(PLAIN, 1, n="many", use_beam_search="true")
    assert refused(r) == (400, "invalid_request", "n"), r.text
    assert sim_received(stack.sim.url) - before == 0
