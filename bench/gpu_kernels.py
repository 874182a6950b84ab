"""Kernel check: the adapters' goldens with the torch fallbacks and with fla, and fla's prefill speed-up.

For every hybrid family of `hypic_core.testing` (tiny random models, fp32), on --device, run twice:
once with every op pinned to its torch fallback ("torch"), once as served ("fast": plain forwards
on whatever `adapters/kernels.py` selects, fla where importable; capture, fused capture and stitch
forwards always run torch). Two goldens each:

- stitched prefill with seam >= segment length equals full prefill: max |logit diff|;
- composed state equals sequential scan: a segment's body operators (captured), composed and
  applied to the state after its head, against the state of a plain forward over the whole
  segment; relative error, worst linear layer.

Then a 2k-token full prefill of the bundled model (models/hypic-tiny, qwen3_5) and of a
bench-sized qwen3_5 (width 512, head dim 128), torch fallback vs fla, in bf16 and fp32: median
time, speed-up, and max |logit diff| (last position) between the two (for information).
Exits 1 when a golden is over its tolerance, or fla is importable but transformers did not bind it.
Measured on an H200 (fla 0.6.0): the goldens with fla are 2-4e-4 (logits) and 1-2e-3 (state),
hence the "fast" tolerances; fla's prefill speed-up was 3.4-3.5x (hypic-tiny) and 1.8x (bf16) /
2.4x (fp32) for the width-512 model. A fresh machine takes ~8 minutes for the whole run, most of
it Triton compiling and autotuning fla's kernels on first use: give it `timeout 600`, or narrow
it with --families / --timed.

On a CUDA machine without network (Python 3.12), from the repository root with .whl/ carried:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 bench/gpu_kernels.py

.whl/ holds transformers==5.24.0, flash-linear-attention and fla-core (0.6.0; fla-core has the
kernels, flash-linear-attention the layers/models) and einops (fla-core's one requirement); all
pure-python wheels. Here (CPU, no fla): .venv/bin/python bench/gpu_kernels.py --device cpu (< 60 s).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic_core.adapters import adapter_for  # noqa: E402
from hypic_core.algebra.operators import compose  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.testing import tiny_model  # noqa: E402

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "olmo_hybrid_nope", "bamba", "granitemoehybrid",
            "nemotron_h", "zamba2", "falcon_h1", "kimi_linear", "minimax"]
LENGTHS = (14, 40, 31, 23, 9, 6)  # system prompt, four chunks, question
SEAM = 8
# (max |logit diff|, relative state error) allowed: torch on CPU, torch on CUDA, a package kernel (fla) on CUDA
TOLERANCE = {"torch-cpu": (1e-4, 1e-4), "torch-cuda": (1e-3, 1e-3), "fast": (2e-2, 1e-2)}


@dataclass
class Golden:
    family: str
    impl: str  # "torch", or the packages the plain forwards ran ("fla", ...)
    logit_diff: float
    state_err: float
    ok: bool


def request(segs, mode, seam=None):
    return GenerationRequest(tuple(segs), mode=mode, seam=seam, sampling=SamplingParams(max_tokens=1))


def packages(adapter, device) -> str:
    used = sorted({impl for ops in adapter.kernel_plan(device).values() for impl in ops.values()} - {"torch"})
    return "+".join(used) or "torch"


def golden(family: str, device: str, pin_torch: bool) -> Golden:
    model = tiny_model(family).to(device)
    engine = Engine(model, config=EngineConfig(seam=SEAM))
    adapter = engine.adapter
    impl = "torch" if pin_torch else packages(adapter, device)
    segs = tuple(tuple(torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(i)).tolist())
                 for i, n in enumerate(LENGTHS))
    with adapter.kernels.torch_only() if pin_torch else contextlib.nullcontext():
        full = engine.prefill(request(segs, "full")).logits
        stitched = engine.prefill(request(segs, "hypic", seam=max(LENGTHS))).logits
        state_err = composed_vs_sequential(adapter, model, segs[1], device)
    logit_diff = (stitched - full).abs().max().item()
    key = "fast" if impl != "torch" else f"torch-{torch.device(device).type}"
    tol_logits, tol_state = TOLERANCE[key]
    ok = logit_diff <= tol_logits and state_err <= tol_state and bool(torch.isfinite(full).all())
    return Golden(family, impl, logit_diff, state_err, ok)


@torch.inference_mode()
def composed_vs_sequential(adapter, model, segment, device: str) -> float:
    """Worst relative error of (ops [w, m) then [m, L)) applied to S_w against S_L from plain forwards."""
    L, w = len(segment), SEAM
    m = (w + L) // 2
    ids = torch.tensor([segment], device=device)
    pos = torch.arange(L, device=device)[None]
    with adapter.capture(0, L) as cap:
        model.base_model(input_ids=ids, position_ids=pos, cache=adapter.new_cache(), use_cache=True)
    ops = [compose([a, b]) for a, b in zip(adapter.span_operators(cap, 0, w, m), adapter.span_operators(cap, 0, m, L))]
    cache = adapter.new_cache()
    model.base_model(input_ids=ids[:, :w], position_ids=pos[:, :w], cache=cache, use_cache=True)
    heads = [adapter.linear_state_or_zero(cache, p)[1].float().clone() for p in range(len(ops))]
    model.base_model(input_ids=ids[:, w:], position_ids=pos[:, w:], cache=cache, use_cache=True)
    errs = []
    for p, op in enumerate(ops):
        ref = adapter.linear_state_or_zero(cache, p)[1].float()
        errs.append(((op.apply(heads[p]) - ref).norm() / ref.norm()).item())
    return max(errs)


# --- timing -------------------------------------------------------------------------------------
def bundled_model(dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ROOT / "models" / "hypic-tiny", dtype=dtype).eval()


def w512_model(dtype):
    """bench/ttft.py's bench_model shape: 8 layers (6 Gated DeltaNet), width 512, linear head dim 128."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, max_position_embeddings=32768, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


TIMED = {"hypic-tiny": bundled_model, "qwen3_5-w512": w512_model}


@torch.inference_mode()
def prefill_ms(model, adapter, ids, reps: int, pin_torch: bool) -> tuple[float, torch.Tensor]:
    def run():
        return model(input_ids=ids, cache=adapter.new_cache(), use_cache=True, logits_to_keep=1).logits[0, -1].float()

    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with adapter.kernels.torch_only() if pin_torch else contextlib.nullcontext():
        logits = run()  # warm-up: Triton compiles and autotunes here
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            run()
            sync()
            times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times), logits


def timing(name: str, dtype: torch.dtype, device: str, tokens: int, reps: int) -> list[str]:
    model = TIMED[name](dtype).to(device)
    adapter = adapter_for(model)
    ids = torch.randint(2, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    torch_ms, torch_logits = prefill_ms(model, adapter, ids, reps, pin_torch=True)
    impl = packages(adapter, device)
    if impl == "torch":
        return [name, str(dtype).removeprefix("torch."), f"{torch_ms:.1f}", "-", "-", "-"]
    fast_ms, fast_logits = prefill_ms(model, adapter, ids, reps, pin_torch=False)
    diff = (fast_logits - torch_logits).abs().max().item()
    return [name, str(dtype).removeprefix("torch."), f"{torch_ms:.1f}", f"{fast_ms:.1f} ({impl})",
            f"{torch_ms / fast_ms:.2f}x", f"{diff:.2e}"]


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def versions() -> str:
    out = [f"torch {torch.__version__}"]
    for dist in ("transformers", "flash-linear-attention", "fla-core", "causal-conv1d", "mamba-ssm", "triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{dist} {importlib.metadata.version(dist)}")
    return ", ".join(out)


def fla_bound(device: str) -> str | None:
    """When fla is importable on CUDA but transformers bound the torch fallback, why (the import error)."""
    if torch.device(device).type != "cuda" or importlib.util.find_spec("fla") is None:
        return None
    if packages(adapter_for(tiny_model("qwen3_5")), device) != "torch":
        return None
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report whatever made transformers fall back
        return f"fla is importable but transformers bound torch: {type(e).__name__}: {e}"
    return "fla is importable but transformers bound torch (import order? fla installed after transformers loaded?)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of the timed full prefill")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5 on CUDA, 1 on CPU)")
    ap.add_argument("--families", nargs="*", default=FAMILIES)
    ap.add_argument("--timed", nargs="*", default=None, help=f"models to time (default: all of {list(TIMED)} on CUDA, "
                    "hypic-tiny on CPU)")
    args = ap.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    reps = args.reps or (5 if cuda else 1)
    timed = args.timed if args.timed is not None else (list(TIMED) if cuda else ["hypic-tiny"])
    torch.set_num_threads(4 if cuda else 1)  # on a busy CPU a second thread spins more than it helps
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {args.device} ({device_name}); {versions()}", flush=True)
    failed = []
    problem = fla_bound(args.device)
    if problem:
        print("FAIL:", problem, flush=True)
        failed.append("fla binding")

    t0 = time.perf_counter()
    rows = []
    for family in args.families:
        plan = next(iter(adapter_for(tiny_model(family)).kernel_plan(args.device).values()), {})
        runs = [True] + ([False] if any(v != "torch" for v in plan.values()) else [])
        for pin in runs:
            try:
                g = golden(family, args.device, pin)
            except Exception as e:  # noqa: BLE001 - one family's failure must not hide the others
                g = Golden(family, "torch" if pin else "fast", float("nan"), float("nan"), False)
                print(f"  {family} ({g.impl}) raised {type(e).__name__}: {e}", flush=True)
            rows.append([g.family, g.impl, f"{g.logit_diff:.2e}", f"{g.state_err:.2e}", "ok" if g.ok else "FAIL"])
            failed += [] if g.ok else [f"{family}/{g.impl}"]
            print(f"  {family:<18} {g.impl:<10} {rows[-1][2]} {rows[-1][3]} {rows[-1][4]}", flush=True)
    print("\nGoldens (fp32 tiny models; impl = what plain forwards ran; capture/stitch always torch)")
    print(table(["family", "impl", "max|Δlogit| stitched vs full", "rel err composed vs sequential", ""], rows))
    print(f"tolerances (logits, state): {TOLERANCE}; {time.perf_counter() - t0:.1f}s\n", flush=True)

    rows = []
    for name in timed:
        for dtype in (torch.bfloat16, torch.float32):
            try:
                rows.append(timing(name, dtype, args.device, args.tokens, reps))
            except Exception as e:  # noqa: BLE001 - report and go on; timing is information, not a golden
                rows.append([name, str(dtype).removeprefix("torch."), f"raised {type(e).__name__}: {e}"[:120],
                             "-", "-", "-"])
            print("  " + "  ".join(rows[-1]), flush=True)
    if rows:
        print(f"\nFull prefill of {args.tokens} tokens, median of {reps} (ms)")
        print(table(["model", "dtype", "torch fallback", "fast", "speed-up", "max|Δlogit| fast vs torch"], rows))
    print(f"\n{'FAIL: ' + ', '.join(failed) if failed else 'all goldens ok'} ({time.perf_counter() - t0:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
