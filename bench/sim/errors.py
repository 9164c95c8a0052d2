"""vLLM's error shapes, reproduced for the simulated engine.

The gateway has its own error tree (gateway/errors.py); this module renders what an
engine says, so that the gateway's handling of engine errors is tested against the real
shapes: `{"error": {"message", "type", "param", "code"}}` where `code` is the HTTP status
as an integer, and the bare `{"error": "Unauthorized"}` of vLLM's auth middleware.
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus

import orjson


class SimError(Exception):
    """An error answered with vLLM's `ErrorResponse` body.

    `type` follows vLLM: handler errors use names such as "BadRequestError" and
    "NotFoundError"; errors raised by FastAPI itself (unknown route, body validation) use
    the HTTP reason phrase ("Not Found", "Bad Request").
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or HTTPStatus(status).phrase
        self.param = param

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


def bad_request(message: str, param: str | None = None) -> SimError:
    """A validation error raised by a serving handler (vLLM's default error type)."""
    return SimError(400, message, "BadRequestError", param)


def invalid_body(message: str) -> SimError:
    """A request body FastAPI/pydantic rejected before the handler ran."""
    return SimError(400, message)


def model_not_found(model: str, served: Sequence[str]) -> SimError:
    """vLLM 0.32's answer (`_check_model`): it names every served alias of the engine."""
    message = f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}."
    return SimError(404, message, "NotFoundError", "model")


UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
