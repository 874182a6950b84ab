"""Typed cache keys that serialize to strings (docs/architecture.md).

A key hashes everything that changes an entry's bytes: the model fingerprint (id, config,
weights digest, dtype, tokenizer), the cache schema version, the seam width and the
segment's token ids. The entry keeps its token ids, compared on every hit.

A `salt` (a namespace the caller sets, e.g. the gateway's tenant, never taken from a request)
makes keys of the same tokens differ, so an entry stored under one salt never serves another;
the empty salt gives the unsalted key strings of before.

An entry `prefix` (the token ids an entry was computed after: `EngineConfig.entry_prefix`) changes
every byte of the entry, so its digest is part of the key: an entry computed under one prefix is
never served under another; no prefix gives the key strings of before.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class SegmentKey:
    model: str  # ModelFingerprint digest
    seam: int
    tokens: str  # sha256 of the int32 token ids
    schema: int = SCHEMA_VERSION
    salt: str = ""  # a namespace (the gateway's tenant); "" for none
    prefix: str = ""  # sha256 of the int32 entry-prefix ids the entry was computed after; "" for none

    @classmethod
    def of(cls, model_fingerprint: str, seam: int, token_ids: tuple[int, ...], salt: str = "",
           prefix: tuple[int, ...] = ()) -> "SegmentKey":
        return cls(model_fingerprint, seam, token_digest(token_ids), salt=salt,
                   prefix=token_digest(prefix) if prefix else "")

    def to_str(self) -> str:
        # The salt appears only as a digest: a key string in a shared tier does not name the tenant.
        salted = f"/s{hashlib.sha256(self.salt.encode()).hexdigest()[:32]}" if self.salt else ""
        prefixed = f"/p{self.prefix[:32]}" if self.prefix else ""
        return f"hypic/v{self.schema}/{self.model[:24]}/w{self.seam}{salted}{prefixed}/{self.tokens}"

    def __str__(self) -> str:
        return self.to_str()


def token_digest(token_ids: tuple[int, ...]) -> str:
    """sha256 of the token ids as int32 bytes."""
    return hashlib.sha256(torch.tensor(token_ids, dtype=torch.int32).numpy().tobytes()).hexdigest()


def model_fingerprint(model: torch.nn.Module, model_id: str, tokenizer=None) -> str:
    """Digest identifying the exact model bytes: id, config, dtype, a weights digest, tokenizer.

    The weights digest hashes every parameter's name, shape and a strided sample of its
    values: cheap at load time, and it changes whenever a checkpoint is retrained.
    """
    h = hashlib.sha256()
    h.update(model_id.encode())
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(model.dtype).encode())
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(flat[::step].to(torch.float32).cpu().numpy().tobytes())
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
        h.update(vocab.encode())
    return h.hexdigest()
