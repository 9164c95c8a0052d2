"""gateway/proxy/metering.py as a table: what the gateway asks of a stream so that it is
metered, for every way vLLM's pydantic reads `stream` and the usage options. Through a
running gateway and simulated engine: tests/e2e/test_metering.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.access.endpoints import TABLE
from gateway.errors import InvalidRequest
from gateway.proxy.metering import plan

BOTH = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/invocations"])
@pytest.mark.parametrize(
    ("body", "asked", "hide_usage", "hide_chunk_usage"),
    [
        ({"stream": True}, BOTH, True, True),
        # vLLM streams these: the gateway asks for the usage.
        ({"stream": "true"}, BOTH, True, True),
        ({"stream": "ON"}, BOTH, True, True),
        ({"stream": 1}, BOTH, True, True),
        ({"stream": 1.0}, BOTH, True, True),
        # `include_usage: "false"` is false: the usage event is asked for and hidden.
        ({"stream": True, "stream_options": {"include_usage": "false"}}, BOTH, True, True),
        ({"stream": True, "stream_options": {"include_usage": 0}}, BOTH, True, True),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, BOTH, False, True),
        # `continuous_usage_stats` alone is ignored by vLLM: the client gets neither.
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, BOTH, True, True),
        (
            {"stream": True, "stream_options": {"include_usage": "1", "continuous_usage_stats": 1}},
            {"include_usage": "1", "continuous_usage_stats": 1},
            False,
            False,
        ),
        (
            {"stream": True, "stream_options": {"include_usage": True, "extra": 1}},
            {**BOTH, "extra": 1},
            False,
            True,
        ),
    ],
)
def test_a_stream_asks_for_its_usage(
    path: str,
    body: dict[str, Any],
    asked: dict[str, Any],
    hide_usage: bool,
    hide_chunk_usage: bool,
) -> None:
    body = copy.deepcopy(body)  # shared by the three paths
    meter, changed = plan(TABLE[path], body, False)
    assert meter.events
    assert body["stream_options"] == asked
    assert changed is (asked is BOTH or "extra" in asked)
    assert (meter.hide_usage, meter.hide_chunk_usage) == (hide_usage, hide_chunk_usage)


@pytest.mark.parametrize("stream", [False, None, "false", "no", "OFF", 0, 0.0, "0"])
def test_a_body_that_does_not_stream_is_left_as_it_is(stream: object) -> None:
    body = {"stream": stream, "stream_options": {"include_usage": "maybe"}}
    meter, changed = plan(TABLE["/v1/chat/completions"], body, False)
    assert not changed and not meter.events
    assert body["stream_options"] == {"include_usage": "maybe"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": "maybe"}, "stream"),
        ({"stream": 2}, "stream"),
        ({"stream": " true"}, "stream"),
        ({"stream": True, "stream_options": "yes"}, "stream_options"),
        (
            {"stream": True, "stream_options": {"include_usage": "sure"}},
            "stream_options.include_usage",
        ),
        (
            {"stream": "y", "stream_options": {"continuous_usage_stats": []}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_what_vllm_would_refuse_is_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        plan(TABLE["/v1/completions"], body, False)
    assert (info.value.code, info.value.param) == ("invalid_request", param)


def test_n_groups_a_prompts_choices() -> None:
    meter, _ = plan(TABLE["/v1/completions"], {"stream": True, "n": 3}, False)
    assert meter.choices == 3
    meter, _ = plan(TABLE["/v1/completions"], {"stream": True, "n": "3"}, False)
    # Not read: each choice its own prompt (the prompt counted more, never less).
    assert meter.choices == 1


@pytest.mark.parametrize(
    ("path", "extra", "single"),
    [
        ("/v1/chat/completions", {"messages": []}, True),
        ("/v1/chat/completions", {"messages": [], "n": 1}, True),
        ("/v1/chat/completions", {"messages": [], "n": 2}, False),
        ("/v1/chat/completions", {"messages": [], "n": "2"}, False),
        ("/v1/chat/completions", {"messages": [], "n": 2.0}, False),
        ("/v1/completions", {"prompt": "a"}, True),
        ("/v1/completions", {"prompt": [1, 2, 3]}, True),
        ("/v1/completions", {"prompt": ["a"]}, True),
        ("/v1/completions", {"prompt": ["a", "b"]}, False),
        ("/v1/completions", {"prompt": [[1], [2]]}, False),
        ("/v1/completions", {"prompt": []}, False),
        ("/v1/completions", {"prompt": "a", "prompt_embeds": "x"}, False),
        ("/v1/completions", {}, False),
        ("/invocations", {"messages": []}, True),
        ("/invocations", {"prompt": ["a", "b"]}, False),
        # `messages` beside a prompt list: vLLM runs every prompt (a completion ignores
        # it; /invocations runs a `messages` chat cannot read as a completion).
        ("/v1/completions", {"messages": [], "prompt": ["a", "b"]}, False),
        ("/invocations", {"messages": "x", "prompt": ["a", "b"]}, False),
        ("/invocations", {"messages": [], "prompt": [[1], [2]]}, False),
    ],
)
def test_a_stream_of_one_prompt_and_one_choice_is_read_as_one(
    path: str, extra: dict[str, Any], single: bool
) -> None:
    # One choice: its last chunk's counts are the stream's (proxy/usage.py, EventUsage).
    meter, _ = plan(TABLE[path], {"stream": True, **extra}, False)
    assert meter.single is single


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
@pytest.mark.parametrize(
    ("measured", "reported", "metered"),
    [
        # The gateway's measure, whatever the answer says or does not say.
        (2.0, None, 2.0),
        (2.0, 2.0, 2.0),
        # vLLM's `usage.seconds`, rounded up; a container that declared less than it holds.
        (2.5, 3.0, 3.0),
        (1.0, 600.0, 600.0),
        # An answer that reports less (or nothing, in the format the client chose).
        (2.5, 0.0, 2.5),
        (30.0, 1.0, 30.0),
        # A file the gateway could not time: the engine's count, else the cap.
        (None, 7.0, 7.0),
        (None, None, 600.0),
    ],
)
def test_audio_is_metered_at_least_the_gateway_s_measure(
    path: str, measured: float | None, reported: float | None, metered: float
) -> None:
    meter, changed = plan(TABLE[path], None, False, seconds=measured, unknown_seconds=600.0)
    assert meter.audio and not changed
    assert meter.audio_seconds(reported) == metered


def test_other_routes_carry_no_seconds() -> None:
    meter, _ = plan(TABLE["/v1/chat/completions"], {}, False, seconds=2.0, unknown_seconds=600.0)
    assert not meter.audio and meter.seconds is None
