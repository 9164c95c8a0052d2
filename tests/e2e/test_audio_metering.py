"""Transcriptions and translations are metered the seconds of audio the gateway measured
of the upload, whatever the response format and whether the answer streams; the
engine's count only when larger (proxy/metering.py). Through the gateway under uvicorn,
the simulated engine (vLLM 0.32's answer shapes: bench/sim/speech.py), and an engine on
loopback that answers `srt` as OpenAI does."""

from __future__ import annotations

import io
import json
import socket
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    RecordingServer,
    Route,
    auth,
    gateway_proc,
    running,
    scrape,
    sim_proc,
    total,
    wait_for,
)
from tests.unit.media.test_samples import av_sample

SCRAPER = "sk-audio-scraper-0123456789-SECRET"
MAX_SECONDS = 60
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"

# name: (route, form fields). Each is metered a 2.0 s clip's seconds.
ANSWERED = {
    "transcription json": (TRANSCRIPTIONS, {}),
    "transcription text": (TRANSCRIPTIONS, {"response_format": "text"}),
    "transcription verbose_json": (TRANSCRIPTIONS, {"response_format": "verbose_json"}),
    "translation json": (TRANSLATIONS, {}),
    "translation text": (TRANSLATIONS, {"response_format": "text"}),
    "translation verbose_json": (TRANSLATIONS, {"response_format": "verbose_json"}),
    "transcription stream": (TRANSCRIPTIONS, {"stream": "true"}),
    "translation stream": (TRANSLATIONS, {"stream": "true"}),
    "transcription stream with usage": (
        TRANSCRIPTIONS,
        {"stream": "true", "stream_include_usage": "true"},
    ),
}
# vLLM 0.32 refuses these formats (400): an error is metered nothing.
REFUSED = {
    "transcription srt": (TRANSCRIPTIONS, {"response_format": "srt"}),
    "transcription vtt": (TRANSCRIPTIONS, {"response_format": "vtt"}),
    "translation srt": (TRANSLATIONS, {"response_format": "srt"}),
}
OTHERS = ("rounded", "unknown", "unknown-reported", "srt-engine", "left")
KEYS = {name: f"sk-audio-{name.replace(' ', '-')}-0123456789" for name in (*ANSWERED, *REFUSED)}
KEYS.update({name: f"sk-audio-{name}-0123456789" for name in OTHERS})

SRT = b"1\n00:00:00,000 --> 00:00:02,000\nSimulated transcription.\n\n"
MODELS = {
    "object": "list",
    "data": [{"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL, "parent": None}],
}


def clip(seconds: float) -> bytes:
    """A WAV file of 8-bit mono PCM at 16 kHz that plays `seconds`."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(16_000)
        w.writeframes(bytes(int(16_000 * seconds)))
    return out.getvalue()


@dataclass
class Stack:
    gateway: Proc
    # A gateway in front of an engine that answers every transcription with SRT text.
    srt_gateway: Proc

    def seconds(self, name: str, gateway: Proc | None = None) -> float:
        url = (gateway or self.gateway).url + "/metrics"
        return total(scrape(url, auth(SCRAPER)), "gateway_audio_seconds_total", key=name)

    def tokens(self, name: str) -> float:
        scraped = scrape(self.gateway.url + "/metrics", auth(SCRAPER))
        return total(scraped, "gateway_prompt_tokens_total", key=name) + total(
            scraped, "gateway_completion_tokens_total", key=name
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("audio-metering")
    keys = [{"key": key, "name": name} for name, key in KEYS.items()]
    keys.append({"key": SCRAPER, "name": "scraper", "scopes": ["metrics"]})
    env = {
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_MEDIA__ALLOW_UNKNOWN_DURATION": "true",
        "GATEWAY_MEDIA__MAX_AUDIO_SECONDS": str(MAX_SECONDS),
    }
    routes = {
        "/health": Route(),
        "/v1/models": Route(
            body=json.dumps(MODELS).encode(), headers={"Content-Type": "application/json"}
        ),
        TRANSCRIPTIONS: Route(body=SRT, headers={"Content-Type": "text/plain; charset=utf-8"}),
        # An engine that takes its time (vLLM 0.32's translation json: no seconds).
        TRANSLATIONS: Route(
            body=b'{"text":"Simulated translation."}',
            headers={"Content-Type": "application/json"},
            delay=1.5,
        ),
    }
    sim = sim_proc(tmp, "--latency", "zero")
    with RecordingServer(routes) as srt_engine, running(sim):
        gateway = gateway_proc(tmp, {**env, "GATEWAY_ENGINES": json.dumps([sim.url])})
        srt_gateway = gateway_proc(tmp, {**env, "GATEWAY_ENGINES": json.dumps([srt_engine.url])})
        with running(gateway, srt_gateway, ready_path="/healthz"):
            for gw in (gateway, srt_gateway):
                assert wait_for(lambda gw=gw: HTTP.get(gw.url + "/readyz").status_code == 200)
            yield Stack(gateway, srt_gateway)


def send(gateway: Proc, name: str, path: str, fields: dict[str, str], audio: bytes) -> bytes:
    """The answer's status line and body, read to the end (a stream too)."""
    filename, mime = ("a.wav", "audio/wav") if audio[:4] == b"RIFF" else ("a.ogg", "audio/ogg")
    files = {"file": (filename, audio, mime)}
    data = {"model": MODEL, **fields}
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", gateway.url + path, headers=auth(KEYS[name]), files=files, data=data
        ) as r,
    ):
        return f"{r.status_code} ".encode() + r.read()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ANSWERED))
def test_every_format_is_metered_the_clip_s_seconds(stack: Stack, name: str) -> None:
    path, fields = ANSWERED[name]
    answer = send(stack.gateway, name, path, fields, clip(2.0))
    assert answer.startswith(b"200 "), answer
    if "stream" in name:
        assert answer.endswith(b"data: [DONE]\n\n")
        assert b'"seconds"' not in answer and b'"duration"' not in answer
    assert wait_for(lambda: stack.seconds(name) == 2.0)
    # Seconds, not tokens: a stream's token counts (`stream_include_usage`) are not metered.
    assert stack.tokens(name) == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFUSED))
def test_a_format_the_engine_refuses_is_not_metered(stack: Stack, name: str) -> None:
    path, fields = REFUSED[name]
    answer = send(stack.gateway, name, path, fields, clip(2.0))
    assert answer.startswith(b"400 "), answer
    assert b"Currently only support response_format" in answer
    scraped = scrape(stack.gateway.url + "/metrics", auth(SCRAPER))
    assert total(scraped, "gateway_requests_total", key=name, status="400") == 1
    assert stack.seconds(name) == 0


@pytest.mark.slow
def test_an_engine_that_answers_srt_is_metered_the_clip_s_seconds(stack: Stack) -> None:
    # vLLM 0.32 serves no `srt`; an engine that does (OpenAI's plain text) is metered
    # the same: the gateway's measure does not depend on what the answer says.
    fields = {"response_format": "srt"}
    answer = send(stack.srt_gateway, "srt-engine", TRANSCRIPTIONS, fields, clip(2.0))
    assert answer == b"200 " + SRT
    assert wait_for(lambda: stack.seconds("srt-engine", stack.srt_gateway) == 2.0)


@pytest.mark.slow
def test_the_engine_s_count_is_taken_only_when_larger(stack: Stack) -> None:
    # 2.5 s: vLLM reports a transcription's `usage.seconds` rounded up (3), a
    # translation's not at all; the gateway's 2.5 is the floor.
    answer = send(stack.gateway, "rounded", TRANSCRIPTIONS, {}, clip(2.5))
    assert json.loads(answer[4:])["usage"] == {"type": "duration", "seconds": 3}
    assert wait_for(lambda: stack.seconds("rounded") == 3.0)
    for fields in ({}, {"stream": "true"}):
        send(stack.gateway, "rounded", TRANSLATIONS, fields, clip(2.5))
    assert wait_for(lambda: stack.seconds("rounded") == 8.0)


@pytest.mark.slow
def test_audio_the_gateway_cannot_time_is_metered_the_engine_s_count_or_the_cap(
    stack: Stack,
) -> None:
    # An Ogg file (allowed by `media.allow_unknown_duration`): a transcription's answer
    # reports its seconds, a translation's and a stream's do not, and count as
    # `media.max_audio_seconds`.
    ogg = av_sample("tone.ogg")
    answer = send(stack.gateway, "unknown-reported", TRANSCRIPTIONS, {}, ogg)
    assert answer.startswith(b"200 "), answer
    reported = json.loads(answer[4:])["usage"]["seconds"]
    assert 0 < reported < MAX_SECONDS
    assert wait_for(lambda: stack.seconds("unknown-reported") == reported)
    for path, fields in ((TRANSLATIONS, {}), (TRANSCRIPTIONS, {"stream": "true"})):
        answer = send(stack.gateway, "unknown", path, fields, ogg)
        assert answer.startswith(b"200 "), answer
    assert wait_for(lambda: stack.seconds("unknown") == 2 * MAX_SECONDS)


@pytest.mark.slow
def test_a_client_that_leaves_before_the_answer_is_metered_the_clip_s_seconds(
    stack: Stack,
) -> None:
    # The engine decodes the whole file before it answers: a client that leaves while
    # it works does not stop the request, whose answer the gateway reads and meters.
    request = httpx.Request(
        "POST",
        stack.srt_gateway.url + TRANSLATIONS,
        headers=auth(KEYS["left"]),
        files={"file": ("a.wav", clip(2.0), "audio/wav")},
        data={"model": MODEL},
    )
    body = request.read()
    head = f"POST {TRANSLATIONS} HTTP/1.1\r\nHost: gateway\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in request.headers.items() if name != "host"
    )
    with socket.create_connection(("127.0.0.1", stack.srt_gateway.port)) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        # The engine answers after 1.5 s; the client leaves well before.
        time.sleep(0.5)
    gateway = stack.srt_gateway
    assert wait_for(lambda: stack.seconds("left", gateway) == 2.0, timeout=30)
    scraped = scrape(gateway.url + "/metrics", auth(SCRAPER))
    assert total(scraped, "gateway_requests_total", key="left", code="client_disconnected") == 1
