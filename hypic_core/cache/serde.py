"""SegmentEntry <-> bytes: safetensors with a metadata header and a checksum (docs/cache.md).

Layout of one value:

    b"HYPICSEG" | payload length (u64 little-endian) | sha256(payload) | payload

The payload is a safetensors file (`SegmentEntry.to_tensors()`), whose header carries the
shapes and stored dtypes of every tensor plus string metadata: schema version, the full
model fingerprint, the key string, the storage precision and each tensor's original dtype.
Nothing here unpickles or calls `torch.load`: safetensors parses a JSON header and copies
raw buffers, and every byte of the payload is checked against the digest before parsing.

Storage precision `"bf16"` stores attention K/V and linear (T, E) in bfloat16 (half the
bytes); `decode` converts them back to the dtypes they were computed in (T, E: fp32).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..algebra.entry import SegmentEntry
from ..algebra.keys import SCHEMA_VERSION, SegmentKey
from ..errors import HypicError

MAGIC = b"HYPICSEG"
_PREFIX = struct.Struct("<8sQ32s")  # magic, payload length, sha256 digest
STORAGE_DTYPES = {"auto": None, "bf16": torch.bfloat16}  # auto: as computed (K/V in the model dtype, T and E fp32)
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)}


class CorruptEntry(HypicError):
    """A stored value that must not be used: damaged, foreign, or of another schema.

    `reason` is one of: "type" (not bytes), "truncated", "magic", "checksum", "schema",
    "model", "key", "storage_dtype", "tokens", "format" (unparseable despite a good
    checksum; a disk row whose text is not UTF-8). Stored tiers add: "refused" (the disk tier
    found a value diskcache would unpickle, or a value file that is not a regular file of its
    row's size inside the directory), "missing" (a value file gone), "size" (a row larger than
    the tier's budget), "unsigned" / "forged" (a Redis value without a valid signature).
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"corrupt cache entry ({reason}): {detail}")
        self.reason = reason


def _lowered(name: str) -> bool:
    """Tensors that the bf16 storage option narrows: attention K/V and linear (T, E)."""
    return name.endswith((".k", ".v", ".T", ".E"))


def encode(entry: SegmentEntry, key: SegmentKey, storage_dtype: str = "auto") -> bytes:
    """Serialize `entry`, stored under `key`, to self-checking bytes. Does not mutate the entry.

    Raises ValueError for an unknown `storage_dtype`. Safe to call from any thread.
    """
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
    narrow = STORAGE_DTYPES[storage_dtype]
    tensors, dtypes = {}, {}
    for name, t in entry.to_tensors().items():
        t = t.detach().to("cpu")
        dtypes[name] = str(t.dtype)
        if narrow is not None and _lowered(name) and t.is_floating_point():
            t = t.to(narrow)
        tensors[name] = t.contiguous()
    meta = {"schema": str(key.schema), "model": key.model, "key": key.to_str(), "storage_dtype": storage_dtype,
            "dtypes": json.dumps(dtypes, sort_keys=True), "seam": str(entry.seam), "length": str(entry.length)}
    payload = st_save(tensors, metadata=meta)
    return _PREFIX.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def decode(data: object, key: SegmentKey, token_ids: tuple[int, ...] | None = None,
           storage_dtype: str | None = None) -> SegmentEntry:
    """Parse bytes from `encode` into a CPU entry, verifying everything before trusting it.

    Checks, in order: type, length, magic, checksum, schema version, model fingerprint, key,
    storage precision (when given), token ids (when given), then the tensor layout.
    Raises CorruptEntry (with `.reason`) on any failure; never raises anything else.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptEntry("type", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _PREFIX.size:
        raise CorruptEntry("truncated", f"{len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, length, digest = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry("magic", f"unknown magic {magic!r}")
    payload = data[_PREFIX.size:]
    if len(payload) != length:
        raise CorruptEntry("truncated", f"payload is {len(payload)} bytes, header says {length}")
    if not hmac.compare_digest(hashlib.sha256(payload).digest(), digest):
        raise CorruptEntry("checksum", "payload digest mismatch")
    try:
        (header_len,) = struct.unpack_from("<Q", payload)
        meta = json.loads(payload[8 : 8 + header_len])["__metadata__"]
        schema, model, stored_key = int(meta["schema"]), meta["model"], meta["key"]
        stored_dtype, dtypes = meta["storage_dtype"], json.loads(meta["dtypes"])
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptEntry("format", f"unreadable metadata: {e}") from None
    if schema != SCHEMA_VERSION:
        raise CorruptEntry("schema", f"schema version {schema}, this build reads {SCHEMA_VERSION}")
    if model != key.model:
        raise CorruptEntry("model", f"written by model {model[:16]}, expected {key.model[:16]}")
    if stored_key != key.to_str():
        raise CorruptEntry("key", f"stored under {stored_key}, looked up as {key.to_str()}")
    if storage_dtype is not None and stored_dtype != storage_dtype:
        raise CorruptEntry("storage_dtype", f"stored as {stored_dtype}, expected {storage_dtype}")
    try:
        tensors = st_load(payload)
        restored = {name: t.to(_DTYPES[dtypes[name]]) for name, t in tensors.items()}
        entry = SegmentEntry.from_tensors(restored)
    except Exception as e:  # noqa: BLE001 - any parse failure of checked bytes is one kind of damage
        raise CorruptEntry("format", f"{type(e).__name__}: {e}") from None
    if token_ids is not None and entry.token_ids != tuple(token_ids):
        raise CorruptEntry("tokens", "stored token ids differ from the looked-up segment")
    return entry
