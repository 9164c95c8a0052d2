"""Engine error answers as clients see them: 4xx scrubbed of addresses, 5xx replaced.

An engine's error message can describe the network behind it: the URL it fetched and the
status it got, connection errors naming host and port, object addresses from Pillow. Once
any media check is bypassed that turns the engine into a port scanner (docs/vllm.md), so the
proxy never relays an error body as sent (proxy/relay.py, `Relay.error`):

- 5xx: replaced by a fixed message with the request id (`errors.EngineError`); the
  original goes to the gateway's log, truncated.
- 4xx: the JSON keeps vLLM's shape and meaning (status, type, param, code), with every
  string passed through `scrub`. A body that is not JSON is replaced like a 5xx one.
- 404 about the request's model (`about_model`): replaced by the gateway's own
  `model_not_found`, since vLLM's lists the engine's served names.

vLLM 0.32 strips some of this itself (`sanitize_message` in
`vllm/entrypoints/serve/exception_handling/utils.py`: ` at 0x...>` and file paths) but
not URLs, hosts, ports or IP addresses, and not in every error path.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

URL = "<url>"
ADDRESS = "<address>"

# scheme://anything up to a space, quote or bracket; and the `//`-less file: and data:.
_URL = re.compile(r"\b(?:[a-z][a-z0-9+.-]{0,30}://|(?:file|data):)[^\s'\"<>`]+", re.I)
# What a URL may end with but a sentence usually does: kept outside the replacement.
_TRAILING = ".,;:!?)]}"
# host:port, the host an IPv6 literal in brackets (`_BRACKETED`), or an IPv4 address or
# a DNS name (`_HOST_PORT`; a name must contain a letter, so `12:30` and `1:2` are left
# alone). IPv6 literals are replaced before names are looked at, or `8a2e:370` inside one
# would read as a name and a port.
# Bounded repetitions only: bodies are scrubbed whole, and nested quantifiers backtrack
# quadratically.
_BRACKETED = re.compile(r"\[[0-9a-f:.]{2,45}\](?::\d{1,5})?(?![\w])", re.I)
_HOST_PORT = re.compile(r"(?<![\w.-])[a-z0-9][a-z0-9.-]{0,252}:\d{1,5}(?![\w])", re.I)
_IPV6 = re.compile(
    r"(?<![\w:.])(?:[0-9a-f]{0,4}:){2,7}(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9a-f]{1,4})?(?![\w:])",
    re.I,
)
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?![\w.]*\w)")
# Python's socket errors print addresses as tuples: ('127.0.0.1', 9).
_ADDRESS_TUPLE = re.compile(r"\(\s*'[^'\n]{1,255}'\s*,\s*\d{1,5}\s*(?:,[^)\n]{0,64})?\)")
_HEX_ADDRESS = re.compile(r"\b0x[0-9a-f]{6,16}\b", re.I)
# How vLLM 0.32 starts every "this model is not served here" message.
_MODEL_MESSAGE = "The model `"
# JSON nesting followed in an error body; deeper values are dropped (None).
_MAX_DEPTH = 32


def _url(m: re.Match[str]) -> str:
    text = m.group(0)
    kept = text.rstrip(_TRAILING)
    return URL + text[len(kept) :]


def _host_port(m: re.Match[str]) -> str:
    text = m.group(0)
    host = text.rsplit(":", 1)[0]
    if any(c.isalpha() for c in host) or _IPV4.fullmatch(host):
        return ADDRESS
    return text


def _is_ipv6(text: str) -> bool:
    # A literal has `::` next to at least one group, or all eight groups: `12:30:45` is
    # a time, and a bare `::` is left alone.
    return ("::" in text and any(c not in ":" for c in text)) or text.count(":") == 7


def _ipv6(m: re.Match[str]) -> str:
    text = m.group(0)
    return ADDRESS if _is_ipv6(text) else text


def _bracketed(m: re.Match[str]) -> str:
    # An address in brackets, not a list of numbers: vLLM prints lists of token ids as
    # `[99999999]` (`token_id(s) [...] in logit_bias`), which is no address.
    text = m.group(0)
    inside = text[1 : text.index("]")]
    return ADDRESS if inside == "::" or _is_ipv6(inside) else text


def scrub(text: str) -> str:
    """`text` with URLs replaced by `<url>` and host:port pairs, IP addresses and memory
    addresses (`0x7f...`) by `<address>`. Everything else is left as it was."""
    if not text:
        return text
    text = _URL.sub(_url, text)
    if "[" in text:
        text = _BRACKETED.sub(_bracketed, text)
    if ":" in text:
        text = _IPV6.sub(_ipv6, text)
        text = _HOST_PORT.sub(_host_port, text)
    if "." in text:
        text = _IPV4.sub(ADDRESS, text)
    if "'" in text:
        text = _ADDRESS_TUPLE.sub(ADDRESS, text)
    if "0x" in text or "0X" in text:
        text = _HEX_ADDRESS.sub(ADDRESS, text)
    return text


def _scrub_value(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if depth >= _MAX_DEPTH:
        return None if isinstance(value, (dict, list)) else value
    if isinstance(value, dict):
        return {scrub(k): _scrub_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub_value(v, depth + 1) for v in value]
    return value


def scrub_json(body: bytes) -> bytes | None:
    """A 4xx error body with every string in it scrubbed, re-encoded; None when the
    body is not JSON (the caller then replaces it)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return orjson.dumps(_scrub_value(parsed, 0))


def about_model(body: bytes) -> bool:
    """Whether an engine's error body is about the request's `model`: vLLM 0.32's
    `_check_model` answers "The model `x` does not exist. Valid aliases: ..." with
    `param: "model"`, naming every alias the engine serves, models the key may not be
    allowed; the caller answers with the gateway's own model_not_found instead. The same
    message comes in Anthropic's envelope (`{"type": "error", "error": {...}}`, no param)
    on /v1/messages and in Cohere's (`{"message": ...}`) on /cohere/v2/*."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(parsed, dict):
        return False
    error = parsed.get("error")
    holder = error if isinstance(error, dict) else parsed
    message = holder.get("message")
    return holder.get("param") == "model" or (
        isinstance(message, str) and message.startswith(_MODEL_MESSAGE)
    )


def excerpt(body: bytes | None, limit: int = 1000) -> str:
    """The start of an engine's error body, for the log line."""
    if body is None:
        return "(not read: over the size cap)"
    text = body[: limit * 4].decode("utf-8", "replace")
    return text if len(text) <= limit else text[:limit] + "..."
