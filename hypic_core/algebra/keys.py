"""Typed cache keys that serialize to strings (docs/architecture.md).

A key hashes everything that changes an entry's bytes: the model fingerprint (id, config,
weights digest, dtype, tokenizer), the cache schema version, the seam width and the
segment's token ids. The entry keeps its token ids, compared on every hit.

A `salt` (a namespace the caller sets, e.g. the gateway's tenant, never taken from a request)
makes keys of the same tokens differ, so an entry stored under one salt never serves another;
the empty salt gives the unsalted key strings of before.
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

    @classmethod
    def of(cls, model_fingerprint: str, seam: int, token_ids: tuple[int, ...], salt: str = "") -> "SegmentKey":
        data = torch.tensor(token_ids, dtype=torch.int32).numpy().tobytes()
        return cls(model_fingerprint, seam, hashlib.sha256(data).hexdigest(), salt=salt)

    def to_str(self) -> str:
        # The salt appears only as a digest: a key string in a shared tier does not name the tenant.
        salted = f"/s{hashlib.sha256(self.salt.encode()).hexdigest()[:32]}" if self.salt else ""
        return f"hypic/v{self.schema}/{self.model[:24]}/w{self.seam}{salted}/{self.tokens}"

    def __str__(self) -> str:
        return self.to_str()


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
