"""Inspecting JSON request bodies: the walk, then the media it found resolved.

The proxy calls this once per JSON request, after auth and the model check:

    inspector = PayloadInspector(settings.media, settings.payload)   # once (lifespan)
    inspection = await inspector.inspect(body, key)
    ...
    await inspector.aclose()                                          # at shutdown

`inspect` mutates `body` in place: media rewritten to validated `data:` URLs (or their
canonical form in passthrough), client identifiers namespaced. It raises `GatewayError`
subclasses (`FieldNotAllowed`, `InvalidRequest`, `MediaUrlNotAllowed`,
`MediaFetchFailed`, `MediaInvalid`, `MediaNotIsolated`, `MediaTooLarge`, `MediaBusy`).
Every check that needs no I/O runs before the first fetch, so a refused request makes no
outbound connection; every header is read, and the request's pixels summed, before the
first decode.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import structlog

from gateway.config.key_file import ApiKey
from gateway.errors import MediaInvalid, MediaNotIsolated, MediaTooLarge
from gateway.media.decoder import Decoder
from gateway.media.fetch import FetchAllowance, MediaFetcher, Resolver
from gateway.media.images import check_formats
from gateway.media.resolve import MediaInliner, Prepared
from gateway.media.settings import MediaSettings
from gateway.media.types import MediaMode
from gateway.media.urls import RemoteUrl, UrlPolicy
from gateway.payload.fields import FieldRules
from gateway.payload.identity import Identity
from gateway.payload.settings import CacheIsolation, PayloadSettings
from gateway.payload.walk import MediaItem, Walk

log = structlog.get_logger("gateway.payload")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Inspection:
    """What inspecting a body found: the content hash of each media item, by the path
    it sits at (in body order), and whether the body was rewritten."""

    media: tuple[tuple[str, str], ...]
    changed: bool


_NOTHING = Inspection((), False)


# Identities kept (`PayloadInspector._identities`); past it the memo starts afresh.
_IDENTITIES_KEPT = 4096


def generate_secret() -> str:
    """A namespace secret for a gateway configured without one, and the warning that
    says what it breaks. Called once per process tree: by the inspector of a single
    process, or by the parent of `serve --workers N`, which hands it to every worker."""
    log.warning(
        "namespace_secret_generated",
        breaks="ids made by this gateway (stored response ids, namespaced media uuids, "
        "session and request ids, cache salts) are unknown to other replicas and after "
        "a restart",
        fix="set payload.namespace_secret (GATEWAY_PAYLOAD__NAMESPACE_SECRET), the same "
        "on every replica",
    )
    return secrets.token_hex(32)


class PayloadInspector:
    """Built once per app from settings; owns the media fetcher (an `httpx.AsyncClient`
    over `SafeTransport`). `decoder` is the image decode pool (the app's lifespan owns
    it); without one the inspector builds and closes its own. `transport` replaces the
    inner transport the safe one wraps (tests), `resolver` the DNS resolver (tests
    simulate rebinding with it)."""

    def __init__(
        self,
        media: MediaSettings,
        payload: PayloadSettings | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        resolver: Resolver | None = None,
        decoder: Decoder | None = None,
    ) -> None:
        check_formats(media.image_formats)
        self._media = media
        self._payload = payload or PayloadSettings()
        self._fields = FieldRules(media, self._payload)
        secret = self._payload.namespace_secret
        self._secret = (generate_secret() if secret is None else secret.get_secret_value()).encode()
        self._policy = UrlPolicy(media)
        self._fetcher = MediaFetcher(media, transport=transport, resolver=resolver)
        self._own_decoder = decoder is None
        self._decoder = decoder or Decoder(media)
        self._inliner = MediaInliner(media, self._fetcher, self._decoder)
        self._isolation = self._payload.cache_isolation
        self._passthrough = media.mode is MediaMode.passthrough
        # Each key's identity, made once: a frozen dataclass costs ~3K instructions to
        # build (callgrind), per request otherwise. By (digest, tenant): a reloaded key
        # may change tenant.
        self._identities: dict[tuple[bytes, str | None], Identity] = {}

    def identity(self, key: ApiKey | None) -> Identity:
        """Identifiers are namespaced by the key itself (its digest), not by its name:
        names are labels an operator may reuse or renumber (`key-3`) in a later file."""
        if key is None:
            return Identity("", "", self._secret)
        memo = (key.digest, key.tenant)
        found = self._identities.get(memo)
        if found is None:
            owner = key.digest.hex()
            tenant = f"tenant:{key.tenant}" if key.tenant is not None else owner
            found = Identity(owner, tenant, self._secret)
            if len(self._identities) >= _IDENTITIES_KEPT:
                self._identities.clear()
            self._identities[memo] = found
        return found

    def owns_response(self, key: ApiKey | None, response_id: str) -> bool:
        """Whether the stored response `response_id` was created by `key` through a
        gateway with this secret (identity.Identity.response_id)."""
        return self.identity(key).owns_response(response_id)

    async def inspect(
        self, body: dict[str, Any], key: ApiKey | None, *, creates_response: bool = False
    ) -> Inspection:
        """`creates_response`: the body is a `POST /v1/responses` (walk.Walk.run)."""
        identity = self.identity(key)
        walk = Walk(self._media, self._fields, self._policy, identity)
        # Every check that needs no I/O, before any fetch.
        walk.run(body, creates_response=creates_response)
        if not walk.items:
            # Most requests carry no media: no tasks, no gather (~1% of the hot path).
            return Inspection((), True) if walk.changed else _NOTHING
        if self._isolation is not CacheIsolation.off:
            self._check_isolable(walk.items)
        # Fetch slots and the decode line are shared fairly between keys: the owner is the
        # key's digest. What the request's URLs may bring in, together
        # (media.max_request_fetch_bytes).
        allowance = FetchAllowance(self._media.max_request_fetch_bytes)
        scope = self._scope(identity)
        prepared = await _all(
            [self._prepare(item, identity.owner, allowance, scope) for item in walk.items]
        )
        pixels = sum(p.pixels for p in prepared if isinstance(p, Prepared))
        if pixels > self._media.max_request_pixels:
            raise MediaTooLarge("The request's images have more pixels than this gateway accepts.")
        finished = await _all(
            [self._finish(item, p, identity) for item, p in zip(walk.items, prepared, strict=True)]
        )
        media = tuple(
            (item.path, digest) for item, (digest, _) in zip(walk.items, finished, strict=True)
        )
        # Unchanged (every item already in its canonical form, nothing namespaced): the
        # proxy forwards the bytes the client sent instead of writing the body again.
        return Inspection(media, walk.changed or any(changed for _, changed in finished))

    def _scope(self, identity: Identity) -> str:
        """Whose share of the media cache a request reads and fills: with tenants
        isolated, its tenant's (or key's) own, so another tenant's item is a miss (a hit
        answers faster: a timing oracle for "has another tenant sent this image")."""
        if self._isolation is CacheIsolation.off:
            return ""
        return identity.tenant if self._isolation is CacheIsolation.tenant else identity.owner

    def _check_isolable(self, items: Sequence[MediaItem]) -> None:
        """With tenants isolated, every media item must reach the engine under a name
        in its tenant's namespace: vLLM keys its multimodal caches on a part's uuid,
        else on the item's bytes, which every tenant shares (a hit answers faster).
        Refused before anything is fetched where no name can be given: a place vLLM
        reads without a uuid (`/v1/messages` blocks, which it rebuilds without one;
        `/v1/systemone`'s URL lists; a part holding more than one media key) and, in
        passthrough, a URL the engine fetches itself (a name for content the gateway
        never saw could go stale under the same URL)."""
        for item in items:
            if item.isolable(self._passthrough):
                continue
            if self._passthrough and isinstance(item.ref, RemoteUrl):
                raise MediaNotIsolated(
                    "This gateway keeps tenants' media apart in the engine's caches; the "
                    "engine would fetch this URL itself, so its content cannot be named "
                    "per tenant. Send the media as a data: URL.",
                    param=item.path,
                )
            raise MediaNotIsolated(
                "This gateway keeps tenants' media apart in the engine's caches, and the "
                "engine reads media here without a name the gateway can give it. Send "
                "each item as its own content part (image_url, input_image, audio_url, "
                "input_audio or video_url) on a route that takes them.",
                param=item.path,
            )

    async def _prepare(
        self, item: MediaItem, owner: str, allowance: FetchAllowance, scope: str
    ) -> Prepared | str:
        """Fetched and checked as far as its header, or its digest when already known."""
        if item.fixed is not None:
            return item.fixed
        try:
            if item.ref is not None:
                return await self._inliner.prepare(item.ref, item.kind, owner, allowance, scope)
            assert item.raw is not None
            return await self._inliner.prepare_bytes(item.kind, *item.raw, owner=owner)
        except (MediaInvalid, MediaTooLarge) as exc:
            exc.param = exc.param or item.path
            raise

    async def _finish(
        self, item: MediaItem, prepared: Prepared | str, identity: Identity
    ) -> tuple[str, bool]:
        """The item's digest, and whether writing its resolved form changed the body."""
        if isinstance(prepared, str):
            return prepared, False
        try:
            resolved = await prepared.finish()
        except (MediaInvalid, MediaTooLarge) as exc:
            exc.param = exc.param or item.path
            raise
        changed = item.apply(resolved) if item.apply is not None else False
        isolated = self._isolation is not CacheIsolation.off
        if isolated and item.part is not None and resolved.data is not None:
            # vLLM keys its multimodal caches (processor, encoder; and the prefix cache's
            # media blocks) on a part's `uuid` when it has one, else on a hash of the
            # model and the item's bytes: the same image from two tenants would be one
            # entry. Named from the digest of the bytes the engine receives (so the same
            # image still hits within a tenant), in the tenant's namespace. A URL the
            # engine fetches itself (passthrough, `data` is None) was refused before
            # (`_check_isolable`).
            item.part["uuid"] = identity.namespaced(
                "media", resolved.digest, tenant=self._isolation is CacheIsolation.tenant
            )
            changed = True
        return resolved.digest, changed

    async def aclose(self) -> None:
        await self._fetcher.aclose()
        if self._own_decoder:
            await self._decoder.aclose()


async def _all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, in order; on the first failure the rest are cancelled (and awaited)
    and the failure raised. One alone is awaited in place (most media requests carry one
    item): no task, no gather."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.create_task(c) for c in coros]
    task: asyncio.Task[T] | None = None
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        # A failed task holds its exception, whose traceback holds this frame: without
        # this, every refused request (its body, its media) would live on in that cycle
        # until a full collection, tens of MiB a request.
        del tasks, task
