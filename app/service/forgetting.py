"""A deleted document's text leaves the cache: its chunks' segment entries, in every tier, and the exact
snapshots that hold them.

A chunk reaches the engine as the segment `Prompter.document(text, title)` writes, under the cache salt
of the request that retrieved it (app/service/tenants.py): its tenant's for a collection of its own; for a
shared collection the shared salt (a /query over shared collections only) or the salt of any tenant that
read it beside other text. So a tenant's document is forgotten under its tenant's salt, and a shared one
under the shared salt and every configured tenant's. Each (segment, salt) is forgotten at every seam width
(hypic_core/cache/forget.py) in the memory tiers, the disk tier and the Redis tier
(`SegmentStore.forget`), and every exact snapshot that contains it is dropped (`ExactRuns.forget`).

A document replaced by an upload of the same id is forgotten the same way, for the chunks its new
version no longer has (`forget_replaced`). What this does not reach: another process's memory and disk
tiers (other replicas keep their entries until evicted; the shared Redis tier is cleared for all), a
document deleted or replaced by `hypic ingest` (another process), and a request running while the
document is deleted, which may still store what it computed. An entry of the same text kept for another
of the tenant's documents is forgotten too (it is recomputed on its next use).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypic_core.algebra.keys import SegmentKey
from hypic_core.cache.forget import SegmentPattern
from retrieval.document import Chunk

from .runtime import Runtime
from .tenants import DEFAULT_TENANT, SHARED_SALT, cache_salt

log = logging.getLogger("hypic.forgetting")


@dataclass(frozen=True)
class Forgotten:
    """What forgetting a document removed."""

    segments: int  # distinct chunk segments forgotten
    salts: int  # salts they were forgotten under
    entries: dict[str, int] = field(default_factory=dict)  # entries removed per tier name
    snapshots: int = 0  # exact snapshots dropped


def salts_of(rt: Runtime, tenant: str, collection: str) -> list[str]:
    """The cache salts `collection`'s text may be cached under (see the module's docstring)."""
    if collection not in rt.collections.shared:
        return [cache_salt(tenant)]
    tenants = sorted({DEFAULT_TENANT, tenant, *rt.settings.tenant_keys.values()})
    return [SHARED_SALT, *dict.fromkeys(cache_salt(t) for t in tenants)]


def chunk_keys(rt: Runtime, chunks: Sequence[Chunk], salts: Sequence[str]) -> list[SegmentKey]:
    """The keys (at seam width 0) of `chunks`' segments under each of `salts`."""
    engine = rt.engine
    segments = dict.fromkeys(rt.prompter.document(c.text, c.title) for c in chunks)
    return [SegmentKey.of(engine.fingerprint, 0, s, salt, engine.config.entry_prefix) for s in segments if s for salt in salts]


def chunks_before(index, document_ids: Sequence[str]) -> dict[str, list[Chunk]]:
    """The chunks `index` holds now for those of `document_ids` it has (what an upload is about to replace)."""
    return {d: index.chunks(d) for d in dict.fromkeys(document_ids) if index.has_document(d)}


def forget_replaced(rt: Runtime, tenant: str, collection: str, index, before: dict[str, list[Chunk]]) -> Forgotten:
    """Once documents were replaced in `index`: forget their chunks of `before` (`chunks_before`) that the new
    versions no longer have (a chunk of the same text and title keeps its entries)."""
    gone = []
    for document_id, old in before.items():
        kept = {(c.text, c.title) for c in index.chunks(document_id)} if index.has_document(document_id) else set()
        gone += [c for c in old if (c.text, c.title) not in kept]
    return forget_chunks(rt, tenant, collection, gone)


def forget_chunks(rt: Runtime, tenant: str, collection: str, chunks: Sequence[Chunk]) -> Forgotten:
    """Remove the cached work of `chunks` (a document of `tenant`'s `collection`, just deleted) from every
    tier of the engine's store and its exact snapshots. Blocks on disk and network I/O: call it on a thread."""
    salts = salts_of(rt, tenant, collection)
    keys = chunk_keys(rt, chunks, salts)
    if not keys:
        return Forgotten(0, len(salts))
    engine = rt.engine
    try:
        entries = engine.store.forget(SegmentPattern.of(keys))
    except NotImplementedError as exc:
        log.warning("deleted document's cache entries stay until evicted: %s", exc)
        entries = {}
    snapshots = engine.exact_runs.forget(k.to_str() for k in keys)  # exact chains hash the width-0 keys
    return Forgotten(len(keys) // len(salts), len(salts), entries, snapshots)
