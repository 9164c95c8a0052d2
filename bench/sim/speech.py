"""/v1/audio/transcriptions and /v1/audio/translations, in vLLM 0.32's answer shapes
(vllm/entrypoints/speech_to_text/: base/serving.py, transcription/ and translation/).

- `json` and `text` are both answered as JSON: a transcription `{"text", "usage":
  {"type": "duration", "seconds"}}` (the seconds rounded up), a translation `{"text"}`
  alone. `verbose_json` gives the exact `duration` and the segments, no `usage`.
- `srt` and `vtt` pass the form's validation and are refused by the handler, 400.
- `stream=true`: `transcription.chunk` / `translation.chunk` events, token counts (never
  seconds) only with `stream_include_usage` (the last event) and
  `stream_continuous_usage_stats` (every event), then `data: [DONE]`.

The audio is not decoded: a WAV file's length is read by the standard library's `wave`
(what a decoder plays of PCM), anything else is counted at 16 kB a second.
"""

from __future__ import annotations

import io
import math
import time
import wave
from typing import Any

from bench.sim.engine import Engine
from bench.sim.errors import SimError, bad_request, invalid_body
from bench.sim.generate import lax_bool
from bench.sim.http import Request, end_stream, respond_json, send_event, start_stream

_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
# The few tokens of Whisper's decoder prompt (<|startoftranscript|><|en|><|transcribe|>
# <|notimestamps|>), before the audio's.
_DECODER_PROMPT = 4


def transcription_text(data: bytes) -> str:
    return f"Simulated transcription of {len(data)} bytes of audio."


def audio_duration(data: bytes) -> float:
    """Seconds `data` plays, as the engine would decode it."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            frames: int = w.getnframes()
            rate: int = w.getframerate()
            return frames / rate
    except (wave.Error, EOFError, ZeroDivisionError):
        return len(data) / 16_000


async def _form(req: Request) -> dict[str, Any]:
    """The form's fields and `file`'s bytes, read with Starlette's parser (as vLLM's
    FastAPI does)."""
    # Imported here, off the startup path: only the audio routes need it.
    from starlette.datastructures import UploadFile
    from starlette.requests import Request as StarletteRequest

    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": req.body, "more_body": False}

    scope = {
        "type": "http",
        "method": req.method,
        "path": req.path,
        "headers": req.headers,
        "query_string": req.query,
    }
    content_type = req.header(b"content-type") or ""
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid_body("Expected a multipart/form-data body with a `file` field.")
    try:
        async with StarletteRequest(scope, replay).form(max_part_size=25 * 1024 * 1024) as form:
            fields: dict[str, Any] = {k: v for k, v in form.items() if k != "file"}
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise invalid_body("file: Field required")
            fields["file"] = await upload.read()
    except SimError:
        raise
    except Exception:
        # python-multipart's errors; the client gets vLLM's generic validation shape.
        raise invalid_body("The multipart body could not be parsed.") from None
    return fields


async def transcriptions(engine: Engine, req: Request) -> None:
    await _speech(engine, req, "transcribe")


async def translations(engine: Engine, req: Request) -> None:
    await _speech(engine, req, "translate")


async def _speech(engine: Engine, req: Request, task: str) -> None:
    form = await _form(req)
    data: bytes = form["file"]
    model = form.get("model")
    served, _ = engine.resolve_model(model if isinstance(model, str) else None)
    fmt = form.get("response_format") or "json"
    if fmt not in _FORMATS and not (task == "transcribe" and fmt == "diarized_json"):
        raise invalid_body(f"response_format: Input should be one of {', '.join(_FORMATS)}")
    stream = lax_bool(form.get("stream") or None, "stream")
    include = lax_bool(form.get("stream_include_usage") or None, "stream_include_usage")
    continuous = include and lax_bool(
        form.get("stream_continuous_usage_stats") or None, "stream_continuous_usage_stats"
    )
    if len(data) > 25 * 1024 * 1024:
        raise SimError(400, "Maximum file size exceeded.", "BadRequestError")
    if fmt not in ("text", "json", "verbose_json", "diarized_json"):
        raise bad_request(
            "Currently only support response_format: "
            "`text`, `json`, `verbose_json` or `diarized_json`"
        )
    if fmt == "diarized_json":
        raise bad_request(f"Currently do not support diarized_json for {served}")
    if fmt == "verbose_json" and stream:
        raise bad_request("verbose_json format doesn't support streaming case")
    text = transcription_text(data)
    seconds = audio_duration(data)
    if stream:
        rid = f"{task}-{engine.request_id(req.header(b'x-request-id'))}"
        await _stream(req, rid, served, task, text, seconds, include, continuous)
        return
    if fmt == "verbose_json":
        segment = {
            "id": 0,
            "avg_logprob": -0.25,
            "compression_ratio": 1.0,
            "end": seconds,
            "no_speech_prob": None,
            "seek": 0,
            "start": 0.0,
            "temperature": 0.0,
            "text": text,
            "tokens": list(range(len(text.split()))),
        }
        verbose: dict[str, Any] = {
            "duration": seconds,
            "language": form.get("language") or "en",
            "text": text,
            "segments": [segment],
        }
        if task == "transcribe":
            verbose["words"] = None
        await respond_json(req.send, verbose)
    elif task == "transcribe":
        # Rounded up, "as per openAI specs".
        usage = {"type": "duration", "seconds": math.ceil(seconds)}
        await respond_json(req.send, {"text": text, "usage": usage})
    else:
        await respond_json(req.send, {"text": text})


async def _stream(
    req: Request,
    rid: str,
    model: str,
    task: str,
    text: str,
    seconds: float,
    include: bool,
    continuous: bool,
) -> None:
    """One event a word; `_speech_to_text_stream_generator`'s shapes (`exclude_unset`)."""
    head = {
        "id": rid,
        "object": "transcription.chunk" if task == "transcribe" else "translation.chunk",
        "created": int(time.time()),
        "model": model,
    }
    # The audio's tokens as Whisper counts them (`get_num_audio_tokens`: the log-mel
    # frames, 16 kHz over a hop of 160 samples).
    prompt = _DECODER_PROMPT + math.ceil(seconds * 100)
    words = text.split(" ")
    await start_stream(req.send)
    for i, word in enumerate(words):
        choice: dict[str, Any] = {"delta": {"content": word if i == 0 else " " + word}}
        if i == len(words) - 1:
            choice.update(finish_reason="stop", stop_reason=None)
        event: dict[str, Any] = {**head, "choices": [choice]}
        if continuous:
            event["usage"] = _usage(prompt, i + 1)
        await send_event(req.send, event)
    if include:
        await send_event(req.send, {**head, "choices": [], "usage": _usage(prompt, len(words))})
    await end_stream(req.send)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
