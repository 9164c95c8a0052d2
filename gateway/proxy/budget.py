"""The memory request bodies hold in one process, charged from a body's first byte until
the engine has it.

    charge = budget.charge(owner)      # one per request, owner: the key's digest
    charge.take(len(chunk))            # as the body arrives, parses, is rewritten
    charge.give(size)                  # as each form of it is dropped
    charge.close()                     # the rest, once the engine has the body

What a request holds: the raw bytes as they arrive and until forwarded (or replaced by
a rewritten body), the parsed object (gateway/proxy/footprint.py) from its parse
until the body to forward is made, and the rewritten body after media inlining until
the engine has it. Past `per_key` for one key: 429 `too_many_body_bytes`; past `limit`
in all: 503 `overloaded`; a request that alone would hold more than a key may: 413
`request_too_large`, which no retry changes. All with nothing forwarded.

Per process, store or not: the budget bounds this process's memory, which a fleet-wide
count could not (docs/gateway.md, "Limits and timeouts").
"""

from __future__ import annotations

from gateway.errors import Overloaded, RequestTooLarge, TooManyBodyBytes


class BodyBudget:
    """Bytes held by request bodies in this process: at most `limit` in all and
    `per_key` for one owner (a key's digest; b"" for requests without a key)."""

    __slots__ = ("held", "limit", "owners", "per_key")

    def __init__(self, limit: int, per_key: int) -> None:
        self.limit = limit
        # A key can never hold more than the whole budget.
        self.per_key = min(per_key, limit)
        self.held = 0
        self.owners: dict[bytes, int] = {}

    def charge(self, owner: bytes) -> Charge:
        return Charge(self, owner)


class Charge:
    """One request's share of a `BodyBudget`. The holder must `close()` it (in a
    `finally`): what it still holds goes back then."""

    __slots__ = ("budget", "held", "owner")

    def __init__(self, budget: BodyBudget, owner: bytes) -> None:
        self.budget = budget
        self.owner = owner
        self.held = 0

    def take(self, amount: int) -> None:
        """Charge `amount` more bytes; raises RequestTooLarge, TooManyBodyBytes or
        Overloaded (nothing charged then)."""
        budget = self.budget
        if self.held + amount > budget.per_key:
            raise RequestTooLarge(
                f"The request body would hold more memory than this gateway allows one "
                f"key ({budget.per_key} bytes)."
            )
        owners = budget.owners
        mine = owners.get(self.owner, 0) + amount
        if mine > budget.per_key:
            raise TooManyBodyBytes(
                "This API key's request bodies hold as much of the gateway's memory as "
                "it allows one key; retry shortly.",
                retry_after=1,
            )
        if budget.held + amount > budget.limit:
            raise Overloaded(
                "The gateway holds as many request bodies as it accepts; retry shortly."
            )
        budget.held += amount
        owners[self.owner] = mine
        self.held += amount

    def give(self, amount: int) -> None:
        """Give back `amount` of the bytes taken (their object was dropped)."""
        if amount > self.held:
            amount = self.held
        if not amount:
            return
        budget = self.budget
        self.held -= amount
        budget.held -= amount
        mine = budget.owners[self.owner] - amount
        if mine:
            budget.owners[self.owner] = mine
        else:
            del budget.owners[self.owner]

    def close(self) -> None:
        if self.held:
            self.give(self.held)
