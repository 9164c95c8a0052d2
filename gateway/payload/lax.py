"""Body fields read the way vLLM reads them: its request models are pydantic v2 models in
lax mode, so the gateway reads a field it acts on with the same rules, or a client
could make the engine do what the gateway did not see (a stream read as "not a
stream", and so not metered).
"""

from __future__ import annotations

from typing import Final

from gateway.errors import InvalidRequest

# pydantic-core's lax `bool` from a string, compared lower-case: measured against
# pydantic 2.14 (pydantic-core 2.50) in vLLM 0.32's environment. Nothing else is a
# boolean string: not " true", "1.0", "" or "01".
_TRUE: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE: Final = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: object, param: str) -> bool | None:
    """`value` as vLLM's pydantic reads a `bool | None` field: None when null or absent.
    Besides true and false it reads the integers 0 and 1, the floats 0.0 and 1.0, and
    the strings of `_TRUE` and `_FALSE` in any case. A value it refuses is refused here
    (`param` names it): the engine would answer 400 all the same."""
    if value is None or type(value) is bool:
        return value
    if type(value) is int or type(value) is float:
        if value == 1:
            return True
        if value == 0:
            return False
    elif type(value) is str:
        text = value.lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise InvalidRequest(f"`{param}` must be a boolean.", param=param)
