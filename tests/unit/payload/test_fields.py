"""The opt-ins: each refused field's boolean setting turns on its `OptIn`, and only it."""

from __future__ import annotations

import pytest

from gateway.media.settings import MediaSettings
from gateway.payload.fields import opted_in
from gateway.payload.rules import FORBIDDEN_ANYWHERE, FORBIDDEN_TOP_LEVEL, FORBIDDEN_TYPES, OptIn
from gateway.payload.settings import PayloadSettings

MEDIA_OPT_INS = {
    "allow_prompt_embeds": OptIn.prompt_embeds,
    "allow_embeds_parts": OptIn.embeds_parts,
    "allow_kv_transfer_params": OptIn.kv_transfer_params,
    "allow_ec_transfer_params": OptIn.ec_transfer_params,
    "allow_media_io_kwargs": OptIn.media_io_kwargs,
    "allow_mm_processor_kwargs": OptIn.mm_processor_kwargs,
    "allow_chat_template": OptIn.chat_template,
}
PAYLOAD_OPT_INS = {
    "allow_pooling_data": OptIn.pooling_data,
    "allow_priority": OptIn.priority,
    "allow_background": OptIn.background,
    "allow_mcp_headers": OptIn.mcp_headers,
}


def test_nothing_is_opted_in_by_default() -> None:
    assert opted_in(MediaSettings(), PayloadSettings()) == frozenset()


@pytest.mark.parametrize(("setting", "opt"), MEDIA_OPT_INS.items())
def test_a_media_setting_turns_on_its_opt_in_alone(setting: str, opt: OptIn) -> None:
    media = MediaSettings.model_validate({setting: True})
    assert opted_in(media, PayloadSettings()) == {opt}


@pytest.mark.parametrize(("setting", "opt"), PAYLOAD_OPT_INS.items())
def test_a_payload_setting_turns_on_its_opt_in_alone(setting: str, opt: OptIn) -> None:
    payload = PayloadSettings.model_validate({setting: True})
    assert opted_in(MediaSettings(), payload) == {opt}


def test_every_opt_in_has_its_setting_and_every_table_names_one() -> None:
    assert {*MEDIA_OPT_INS.values(), *PAYLOAD_OPT_INS.values()} == set(OptIn)
    named = {*FORBIDDEN_ANYWHERE.values(), *FORBIDDEN_TYPES.values(), *FORBIDDEN_TOP_LEVEL.values()}
    # `background` is checked by its value (only absent, null or false pass), not by
    # presence; a tool's `headers` by where they sit (in `tools`).
    assert named - {None} == set(OptIn) - {OptIn.background, OptIn.mcp_headers}
