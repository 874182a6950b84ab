"""Accuracy cost of storing cached K/V and linear (T, E) in bf16 instead of fp32.

Random multi-segment requests on a tiny slow-decay Qwen3.5 model (`hypic_core.testing`),
`hypic` mode. For each request the canonical entries are computed once; the fp32 run serves
them as computed (what fp32 storage returns: the serde roundtrip is lossless), the bf16 run
serves them after an `encode(..., "bf16")` / `decode` roundtrip. Reported: first-token KL
(fp32 storage || bf16 storage), first-token argmax agreement, greedy agreement over
`--max-tokens` tokens, and for scale the KL of hypic itself vs full prefill.

    python bench/storage_precision.py [--requests 32] [--max-tokens 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from hypic_core.algebra.keys import SegmentKey  # noqa: E402
from hypic_core.cache import decode, encode  # noqa: E402
from hypic_core.cache.store import MemorySegmentStore  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.testing import tiny_model  # noqa: E402

SEAM = 8


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    return torch.sum(p.exp() * (p - torch.log_softmax(q_logits.double(), -1))).item()


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens generated alike before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = tiny_model("qwen3_5")
    config = EngineConfig(seam=SEAM)
    fp32 = Engine(model, config=config)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for _ in range(args.requests):
        lengths = torch.randint(16, 65, (5,), generator=g).tolist() + [8]
        segments = tuple(tuple(torch.randint(2, 320, (n,), generator=g).tolist()) for n in lengths)
        req = GenerationRequest(segments, sampling=SamplingParams(max_tokens=args.max_tokens))
        entries, _ = fp32.segment_entries(req.context, SEAM)
        narrow = MemorySegmentStore(1 << 30)
        for seg, entry in zip(req.context, entries):
            key = SegmentKey.of(fp32.fingerprint, SEAM, seg)
            narrow.insert(key, decode(encode(entry, key, "bf16"), key, seg, "bf16"))
        bf16 = Engine(model, config=config, store=narrow)
        ref = fp32.prefill(req)
        low = bf16.prefill(req)
        assert low.stats.segment_hits == len(req.context)
        full = fp32.prefill(GenerationRequest(segments, mode="full")).logits
        ref_tokens = [e.token_id for e in fp32.generate(req, prefilled=ref)]
        low_tokens = [e.token_id for e in bf16.generate(req, prefilled=low)]
        rows.append((kl(ref.logits, low.logits), int(ref.logits.argmax() == low.logits.argmax()),
                     agreement(ref_tokens, low_tokens), len(ref_tokens), int(ref_tokens == low_tokens),
                     kl(full, ref.logits), (ref.logits - low.logits).abs().max().item()))

    kls = [r[0] for r in rows]
    print(f"model: tiny qwen3_5 (slow decay), seam {SEAM}, {len(rows)} requests of 5 segments (16-64 tokens) "
          f"+ 8-token question, greedy {args.max_tokens} tokens, seed {args.seed}")
    print()
    print("metric | value")
    print("--- | ---")
    print(f"first-token KL(fp32 storage || bf16 storage), mean | {statistics.mean(kls):.2e}")
    print(f"first-token KL, max | {max(kls):.2e}")
    print(f"first-token logits max abs diff, max | {max(r[6] for r in rows):.2e}")
    print(f"first-token argmax agreement | {sum(r[1] for r in rows)}/{len(rows)}")
    print(f"greedy sequences identical | {sum(r[4] for r in rows)}/{len(rows)}")
    print(f"greedy tokens agreeing before first difference | {sum(r[2] for r in rows)}/{sum(r[3] for r in rows)}")
    print(f"for scale: first-token KL(full || hypic fp32), mean | {statistics.mean(r[5] for r in rows):.2e}")


if __name__ == "__main__":
    main()
