"""gateway/payload/lax.py against pydantic itself: every value is read as a pydantic v2
`bool | None` field reads it (vLLM's request models), refused where pydantic refuses."""

from __future__ import annotations

import pydantic
import pytest

from gateway.errors import InvalidRequest
from gateway.payload.lax import lax_bool

VALUES = [
    None, True, False, 0, 1, 2, -1, 0.0, -0.0, 1.0, 1.5, float("nan"),
    "true", "True", "TRUE", "tRuE", "yes", "YES", "on", "On", "1", "t", "T", "y", "Y",
    "false", "False", "no", "NO", "off", "Off", "0", "f", "F", "n", "N",
    "", " true", "true ", "1.0", "0.0", "01", "+1", "10", "truee", "nope", "null",
    "\u212a", "ｔｒｕｅ", [], {}, [True], {"a": 1},
]  # fmt: skip

_PYDANTIC = pydantic.TypeAdapter(bool | None)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_lax_bool_reads_what_pydantic_reads(value: object) -> None:
    try:
        expected: bool | str | None = _PYDANTIC.validate_python(value)
    except pydantic.ValidationError:
        expected = "refused"
    try:
        got: bool | str | None = lax_bool(value, "stream")
    except InvalidRequest as exc:
        assert exc.param == "stream"
        got = "refused"
    assert got == expected
