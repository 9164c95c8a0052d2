"""Which headers cross the gateway: both directions are allowlists.

To an engine go only the headers an engine needs, so a header vLLM acts on can never be
sent by a client: `Content-Type` (set by the proxy from the value it validated, never
copied), `Accept`, `User-Agent`, the gateway's own `X-Request-Id` and the engine key in
`Authorization`, plus the operator's `forward_headers` (for tracing). To a client go only
the engine response headers in `RESPONSE_HEADERS`; the gateway adds its own
`X-Request-Id`. docs/gateway.md, "Headers", has both lists and the reasons.

Checked against vLLM 0.32.0's source (`vllm/entrypoints/**`, and the SageMaker wrapper
`model_hosting_container_standards` 0.1.16 that vLLM's `/invocations` runs under).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

# Request headers copied from the client as sent (ASGI names are lowercase bytes).
# Accept-Encoding is not among them: vLLM 0.32 compresses nothing, and the gateway reads
# engine error bodies and model lists as plain JSON to scrub or filter them.
FORWARD_HEADERS: Final = frozenset({b"accept", b"user-agent"})

# Engine response headers a client gets. vLLM 0.32 sends content-type and
# content-length; `metadata` carries the JSON description of a binary pooling response
# (`encoding_format: "bytes"`), without which its body cannot be decoded. Everything
# else is dropped: `endpoint-load-metrics` (engine load, see below), the engine's own
# `x-request-id`, `server`, `date`, hop-by-hop headers, CORS headers, SageMaker session
# headers, whatever a `--middleware` adds.
RESPONSE_HEADERS: Final = frozenset({b"content-type", b"content-length", b"metadata"})

# Names `forward_headers` may not add.
NEVER_FORWARD: Final = frozenset(
    {
        # Hop-by-hop (RFC 9110 7.6.1).
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        # Set by the gateway itself.
        "host",
        "content-length",
        "content-type",
        "authorization",
        "expect",
        "x-request-id",
        # Read by vLLM 0.32: engine load in a response header (orca_metrics.py), the
        # data-parallel rank, the scheduling priority and the session id
        # (generate/base/serving.py).
        "endpoint-load-metrics-format",
        "x-data-parallel-rank",
        "x-vllm-priority",
        "x-session-id",
        # Read by the CORS middleware vLLM installs.
        "origin",
        "access-control-request-method",
        "access-control-request-headers",
        "forwarded",
    }
)
NEVER_FORWARD_PREFIXES: Final = (
    # The SageMaker wrapper of /invocations: the adapter identifier replaces the body's
    # `model`, the session id selects a stateful session.
    "x-amzn-sagemaker-",
    # Reserved for vLLM's own headers.
    "x-vllm-",
    # uvicorn, which serves vLLM, trusts X-Forwarded-For/-Proto from 127.0.0.1 by
    # default: a sidecar gateway is exactly that peer.
    "x-forwarded-",
)
# RFC 9110 5.6.2 token.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


def forwardable(names: Iterable[str]) -> list[str]:
    """`names` normalised to lower case; ValueError for a name that is not an HTTP
    token or that the gateway never forwards."""
    out: list[str] = []
    for raw in names:
        name = raw.strip().lower()
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"forward_headers: {raw!r} is not a header name")
        if name in NEVER_FORWARD or name.startswith(NEVER_FORWARD_PREFIXES):
            raise ValueError(
                f"forward_headers: {name!r} is never forwarded (the gateway sets it, "
                "it is hop-by-hop, or vLLM acts on it)"
            )
        if name not in out:
            out.append(name)
    return out


def request_allowlist(extra: Iterable[str]) -> frozenset[bytes]:
    """The request headers copied to engines: the fixed set and the checked `extra`."""
    return FORWARD_HEADERS | {name.encode("latin-1") for name in forwardable(extra)}
