"""Tenants: who a request acts for, the collections of documents it may reach, its cache salt, its quotas.

An API key opens one tenant (`Settings.tenant_keys`: api_key opens 'default', api_keys and
api_keys_file map each key to a tenant); without any key every request is the tenant 'default'.
A tenant's documents live in collections, one `VectorIndex` directory each:

    index_dir                                   tenant 'default', collection 'default' (the one index of before)
    <collections_root>/<tenant>/<collection>    every other tenant's collections
    <collections_root>/_shared/<collection>     a shared collection (`Settings.shared_collections`)

A request names collections only by name and always within its own tenant (or a shared
collection), and names are checked (1-63 of a-z 0-9 _ -), so no request reaches another tenant's
directory: a tenant never retrieves, lists, deletes or is answered from another's documents.

The cache is isolated the same way: every generation carries its tenant's `cache_salt` (set here
from the key, never from the request) into every cache key it builds, so no segment entry, exact
snapshot or sighting computed for one tenant serves another. A request whose context holds only
shared text (a /query over shared collections only) runs under the shared salt, so tenants share
those entries, by configuration.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hypic_core.errors import InvalidRequestError
from retrieval.document import Chunk
from retrieval.errors import DocumentNotFoundError
from retrieval.index import MANIFEST_NAME, SearchHit, VectorIndex

from .errors import CollectionReadOnlyError, QuotaExceededError, UnknownCollectionError

DEFAULT_TENANT = "default"
DEFAULT_COLLECTION = "default"
SHARED_SALT = "shared"
SHARED_DIR = "_shared"  # a tenant name cannot start with "_"
MAX_COLLECTIONS = 16  # collections one request may search
MAX_TENANT_COLLECTIONS = 256  # collections one tenant may create (each stays open once used)
MAX_LABELLED_TENANTS = 64  # tenants with their own metric labels; the rest are counted as "other"
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def check_tenant_name(value: object, param: str) -> str:
    """`value` if it can name a tenant, else ValueError naming `param`."""
    if not isinstance(value, str) or not NAME.match(value):
        raise ValueError(f"{param}: tenant names are 1-63 of a-z 0-9 _ - starting with a letter or digit, got {str(value)[:80]!r}")
    return value


def check_collection_name(value: object, param: str) -> str:
    """`value` if it can name a collection, else `InvalidRequestError` naming `param`."""
    if not isinstance(value, str) or not NAME.match(value):
        raise InvalidRequestError(param, "a collection name is 1-63 of a-z 0-9 _ - starting with a letter or digit, "
                                         f"got {str(value)[:80]!r}")
    return value


def check_shared_collection_name(value: object, param: str) -> str:
    """`value` if it can name a shared collection, else ValueError naming `param`: a collection name, and not
    DEFAULT_COLLECTION (every tenant's own index, the one a request without `collections` reads: shared, a
    tenant's upload without a collection would be listed by every other and the operator's index would
    be hidden)."""
    check_collection_name(value, param)
    if value == DEFAULT_COLLECTION:
        raise ValueError(f"{param}: {DEFAULT_COLLECTION!r} is every tenant's own collection and cannot be shared; "
                         "give the shared collection another name")
    return value


def parse_keys(source: str | Mapping, param: str) -> dict[str, str]:
    """{key: tenant} from a JSON object (text or parsed); ValueError naming `param` for anything else."""
    try:
        found = json.loads(source) if isinstance(source, str) else source
    except ValueError as exc:
        raise ValueError(f"{param}: not JSON ({exc}); expected {{\"<key>\": \"<tenant>\", ...}}") from None
    if not isinstance(found, Mapping):
        raise ValueError(f"{param}: expected a JSON object {{\"<key>\": \"<tenant>\", ...}}")
    keys = {}
    for key, tenant in found.items():
        if not isinstance(key, str) or not key.strip() or key != key.strip() or any(c.isspace() for c in key):
            raise ValueError(f"{param}: a key must be non-empty text without spaces")
        keys[key] = check_tenant_name(tenant, param)
    return keys


def cache_salt(tenant: str) -> str:
    """The namespace of `tenant`'s cache entries: '' (the unsalted keys of a gateway without tenants)
    for 'default', else one per tenant."""
    return "" if tenant == DEFAULT_TENANT else f"tenant:{tenant}"


@dataclass(frozen=True)
class CollectionHit(SearchHit):
    """A search hit and the collection it came from."""

    collection: str = DEFAULT_COLLECTION


class Collections:
    """Every tenant's collections (see the module's docstring); opened on first use and kept open.
    Thread-safe; opening reads the disk, so call it off the event loop."""

    def __init__(self, root: Path, default_index: VectorIndex, shared: Mapping[str, Sequence[str]] | None = None) -> None:
        self.root = Path(root)
        self.shared = {name: frozenset(writers) for name, writers in (shared or {}).items()}
        self.embedder = default_index.embedder
        self._open: dict[tuple[str, str], VectorIndex] = {(DEFAULT_TENANT, DEFAULT_COLLECTION): default_index}
        self._lock = threading.Lock()

    def _owner(self, tenant: str, name: str) -> str:
        return SHARED_DIR if name in self.shared else tenant

    def directory(self, tenant: str, name: str) -> Path:
        """Where `tenant`'s collection `name` is (a shared one: the same for every tenant)."""
        return self.root / self._owner(tenant, name) / name

    def exists(self, tenant: str, name: str) -> bool:
        """Whether `tenant` can read collection `name`: its 'default' always (empty until written), a shared
        one always, another once something was written to it."""
        return name == DEFAULT_COLLECTION or name in self.shared or (self.directory(tenant, name) / MANIFEST_NAME).is_file()

    def get(self, tenant: str, name: str, param: str = "collection", create: bool = False) -> VectorIndex:
        """`tenant`'s collection `name`; `UnknownCollectionError` naming `param` when it does not exist
        (unless `create`: a new one, written to disk with its first document)."""
        check_collection_name(name, param)
        if not create and not self.exists(tenant, name):
            raise UnknownCollectionError(param, f"no collection {name!r}; GET /collections lists yours")
        key = (self._owner(tenant, name), name)
        with self._lock:
            index = self._open.get(key)
            if index is None:
                index = self._open[key] = VectorIndex(self.directory(tenant, name), self.embedder)
        return index

    def writable(self, tenant: str, name: str, param: str = "collection", create: bool = True) -> VectorIndex:
        """`get` for a write: `CollectionReadOnlyError` for a shared collection `tenant` may not write,
        `QuotaExceededError` for a new one past MAX_TENANT_COLLECTIONS."""
        check_collection_name(name, param)
        if name in self.shared and tenant not in self.shared[name]:
            raise CollectionReadOnlyError(param, f"collection {name!r} is shared and read-only for this key's tenant")
        if create and not self.exists(tenant, name) and len(self.names(tenant)) - len(self.shared) >= MAX_TENANT_COLLECTIONS:
            raise QuotaExceededError("collections", f"the tenant has {MAX_TENANT_COLLECTIONS} collections, the most allowed; "
                                                    "add to one of them (GET /collections)")
        return self.get(tenant, name, param, create=create)

    def names(self, tenant: str) -> list[str]:
        """The collections `tenant` can read: its own ('default' first) and the shared ones."""
        own = {DEFAULT_COLLECTION}
        folder = self.root / tenant
        if folder.is_dir():
            own |= {p.name for p in folder.iterdir() if NAME.match(p.name) and (p / MANIFEST_NAME).is_file()}
        return sorted(own - set(self.shared), key=lambda n: (n != DEFAULT_COLLECTION, n)) + sorted(self.shared)

    def counted(self, tenant: str) -> list[str]:
        """The collections whose documents count against `tenant`'s quota: its own and the shared ones it writes."""
        return [n for n in self.names(tenant) if n not in self.shared or tenant in self.shared[n]]

    def search(self, tenant: str, names: Sequence[str], query: str, top_k: int, document_ids: Sequence[str] | None,
               param: str = "collections") -> list[CollectionHit]:
        """The `top_k` chunks closest to `query` in `tenant`'s collections `names`, best first (only from
        `document_ids` when given: each must be in one of them). Raises `UnknownCollectionError` naming
        `param[i]`, `DocumentNotFoundError`, and what `VectorIndex.search` raises."""
        indexes = [(name, self.get(tenant, name, f"{param}[{i}]")) for i, name in enumerate(names)]
        if len(indexes) == 1:
            name, index = indexes[0]
            return [CollectionHit(h.score, h.chunk, name) for h in index.search(query, top_k, document_ids)]
        wanted = None if document_ids is None else list(dict.fromkeys(document_ids))
        query = indexes[0][1].query_vector(query)  # embedded once for every collection (one embedder)
        hits: list[CollectionHit] = []
        held: set[str] = set()
        for name, index in indexes:
            ids = None if wanted is None else [d for d in wanted if index.has_document(d)]
            if ids is not None:
                held.update(ids)
                if not ids:
                    continue
            hits += [CollectionHit(h.score, h.chunk, name) for h in index.search(query, top_k, ids)]
        missing = [d for d in wanted or () if d not in held]
        if missing:
            raise DocumentNotFoundError(missing[0])
        return sorted(hits, key=lambda h: -h.score)[:top_k]

    def salt(self, tenant: str, names: Sequence[str]) -> str:
        """The cache salt of a request over collections `names` whose other context is the deployment's own
        (a /query): the shared salt when every one is shared, else the tenant's."""
        return SHARED_SALT if names and all(n in self.shared for n in names) else cache_salt(tenant)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(documents, bytes of chunk text) in the collections counted against `tenant`'s quota."""
        documents = size = 0
        for name in self.counted(tenant):
            n, b = self.get(tenant, name).usage()
            documents, size = documents + n, size + b
        return documents, size


class Quotas:
    """Per-tenant limits: documents and bytes of chunk text kept (0: none), requests in flight (0: none)."""

    def __init__(self, max_documents: int = 0, max_bytes: int = 0, max_requests: int = 0) -> None:
        self.max_documents = max_documents
        self.max_bytes = max_bytes
        self.max_requests = max_requests
        self._in_flight: dict[str, int] = {}
        self._uploads: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def enter(self, tenant: str) -> None:
        """Count a request of `tenant` in flight; `QuotaExceededError` when it already has `max_requests`."""
        with self._lock:
            n = self._in_flight.get(tenant, 0)
            if self.max_requests and n >= self.max_requests:
                raise QuotaExceededError("requests", f"tenant has {n} requests in flight, the most allowed "
                                                     "(HYPIC_TENANT_MAX_REQUESTS); retry when one has finished")
            self._in_flight[tenant] = n + 1

    def leave(self, tenant: str) -> None:
        with self._lock:
            n = self._in_flight.get(tenant, 0) - 1
            if n > 0:
                self._in_flight[tenant] = n
            else:
                self._in_flight.pop(tenant, None)

    def in_flight(self, tenant: str) -> int:
        with self._lock:
            return self._in_flight.get(tenant, 0)

    def upload_lock(self, tenant: str) -> threading.Lock:
        """Held around a tenant's quota check and write, so two uploads cannot both pass one check."""
        with self._lock:
            return self._uploads.setdefault(tenant, threading.Lock())

    def admit(self, collections: Collections, tenant: str, index: VectorIndex, chunks: Sequence[Chunk]) -> None:
        """`QuotaExceededError` unless `tenant` stays within its document and byte limits once `chunks`
        (replacing the documents of the same ids in `index`) are written."""
        if not self.max_documents and not self.max_bytes:
            return
        ids = list(dict.fromkeys(c.document_id for c in chunks))
        documents, size = collections.usage(tenant)
        replaced_docs, replaced_bytes = index.usage(ids)
        documents += len(ids) - replaced_docs
        size += sum(len(c.text.encode("utf-8", "surrogatepass")) for c in chunks) - replaced_bytes
        if self.max_documents and documents > self.max_documents:
            raise QuotaExceededError("documents", f"the tenant would keep {documents} documents, more than the "
                                                  f"{self.max_documents} allowed (HYPIC_TENANT_MAX_DOCUMENTS); delete some first")
        if self.max_bytes and size > self.max_bytes:
            raise QuotaExceededError("bytes", f"the tenant would keep {size} bytes of text, more than the {self.max_bytes} "
                                              "allowed (HYPIC_TENANT_MAX_BYTES); delete some first")


ALL_TENANTS = "all"  # the one `tenant` label value while tenant names stay off /metrics


class TenantLabels:
    """Metric label values for tenants. /metrics needs no key, so tenant names are label values only where
    the operator opts in (`named`, HYPIC_METRICS_TENANT_LABELS): then the configured tenants (and
    'default') up to MAX_LABELLED_TENANTS, anything else "other"; otherwise every tenant is ALL_TENANTS."""

    def __init__(self, tenants: Sequence[str], limit: int = MAX_LABELLED_TENANTS, named: bool = False) -> None:
        self.named = named
        self.known = frozenset(sorted({DEFAULT_TENANT, *tenants})[:limit]) if named else frozenset()

    def __call__(self, tenant: str) -> str:
        if not self.named:
            return ALL_TENANTS
        return tenant if tenant in self.known else "other"
