"""The shared store (Redis): one client for what every worker and replica must share.

`client.py` holds the connection and its breaker, `limits.py` the per-key limits,
`failures.py` the failed-authentication counts; routing/store.py keeps anchor
placements through the same client (docs/gateway.md, "The shared store").
"""
