"""Per-token decode latency: the HF-module path against the lean step, beside the machine's floor.

For each number of streams B: B prompts are prefilled (random tokens, `--context` each), then the
decode batch runs `--steps` x `--reps` greedy steps on the module path (`DecodeBatch.forward`
through the HF modules, on a model copy the step never touched) and on the lean step
(hypic_core/runner/decode_step.py), in lockstep (one step of each in turn, the order alternating)
from the same prompts, so load on a shared machine hits both alike. Reported: the median step (ms), ms per token (step / B), tok/s, and the floor: the
bytes of the weights one step reads (every parameter but the embedding table, whose lookup reads B
rows; a tied lm_head reads it in full once) at this machine's measured bandwidth (sum of a large
tensor; a copy is printed too). With `--split`, one profiled run per path splits a step by layer
kind (torch.profiler record_function ranges: module hooks on the HF path, the step's own ranges
on the lean one and each `--kernel` path); "other" is what no range covers (embedding, rotary, masks, cache objects, the
Python between modules). Sampling (argmax of the logits) is timed apart.

With `--kernel native [native-f16 native-i8]`, one more path per kernel: the lean step on that op
table (hypic_core/runner/ops.py `NativeOps`: native/decode_matmul.py's matmuls and its native ops
for the norms, attention, Mamba2 and the MLP's gate), in the same lockstep. Each path's logits'
largest difference from the lean step's (torch's ops) at the first timed step is printed beside it.

The paths are engines built with EngineConfig(decode_step=..., decode_kernel=...) and stepped through
the runner's one benchmark seam, `ModelRunner.decoding` (bench/harness.py).

Run:  .venv/bin/python bench/decode.py --model smollm2-135m-instruct --threads 2 [--streams 1 2 4 8]
      [--steps 32 --context 256 --reps 3 --dtype float32 --split --kernel native native-f16]
`--model` takes a directory or a registry name (hypic models list).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from harness import Timer, decode_rows, engine as make_engine, load_average, model_path

from hypic_core.config import DECODE_KERNELS, GenerationRequest
from hypic_core.engine.engine import Engine


def bandwidth(mb: int = 512, reps: int = 5) -> tuple[float, float]:
    """(GB/s reading a `mb` MB fp32 tensor with sum, GB/s of a copy counting read + write), best of `reps`,
    on torch's current thread count."""
    x = torch.ones(mb * (1 << 20) // 4)
    y = torch.empty_like(x)
    n = x.numel() * 4
    best_sum = best_copy = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        float(x.sum())
        best_sum = min(best_sum, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        best_copy = min(best_copy, time.perf_counter() - t)
    return n / best_sum / 1e9, 2 * n / best_copy / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters one decode step reads: all but the input embedding table, unless the
    lm_head is that same table (tied), which it then reads in full."""
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p.data_ptr() == emb.data_ptr() and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


class ModuleRanges:
    """record_function ranges around the HF modules of each layer kind (forward hooks), for the profiler."""

    def __init__(self, model: torch.nn.Module, adapter):
        self.handles, self.stack = [], []
        base = model.base_model
        linear = set(adapter.linear_layers)
        for i, layer in enumerate(base.layers):
            kind = "attention"
            if i in linear and getattr(layer, "self_attn", None) is None:
                kind = "mamba2" if getattr(layer, "mamba", None) is not None else "gated_deltanet"
            mixer = (getattr(layer, "self_attn", None) or getattr(layer, "mamba", None)
                     or getattr(layer, "linear_attn", None))
            mlp = getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)
            norm2 = getattr(layer, "post_attention_layernorm", None) or getattr(layer, "pre_ff_layernorm", None)
            for module, name in ((layer.input_layernorm, kind), (mixer, kind), (norm2, "mlp"), (mlp, "mlp")):
                if module is not None:
                    self._wrap(module, name)
        self._wrap(model.get_output_embeddings(), "lm_head")
        final = getattr(base, "norm", None) or getattr(base, "final_layernorm", None)
        if final is not None:
            self._wrap(final, "lm_head")

    def _wrap(self, module, name):
        def pre(*_):
            rf = torch.profiler.record_function(name)
            rf.__enter__()
            self.stack.append(rf)

        def post(*_):
            self.stack.pop().__exit__(None, None, None)

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self):
        for h in self.handles:
            h.remove()


def run(engine: Engine, caches: list, positions: list[int], steps: int, profile: bool = False):
    """Decode `steps` greedy steps of every row from copies of `caches` on `engine`'s decode forward.
    Returns (per-step seconds, profiler or None)."""
    n = len(caches)
    pos, tokens = list(positions), [5] * n
    timer = Timer()
    with decode_rows(engine, caches, ranges=profile) as step:
        for _ in range(2):  # warm: buffers grown, first-call costs paid
            tokens = step(tokens, pos).argmax(-1).tolist()
            pos = [p + 1 for p in pos]
        ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
        prof = ctx.__enter__() if ctx is not None else None
        for _ in range(steps):
            with timer:
                logits = step(tokens, pos)
            tokens = logits.argmax(-1).tolist()
            pos = [p + 1 for p in pos]
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return timer.seconds, prof


def lockstep(engines: dict[str, Engine], caches: dict[str, list], positions: list[int], steps: int):
    """Every path decodes the same rows, one step each in turn (the order alternating step by step), so
    a shared machine's load falls on all alike. Returns (seconds per step by path, sampling seconds, each
    path's logits at the first timed step)."""
    names = list(engines)
    with contextlib.ExitStack() as stack:
        steppers = {name: stack.enter_context(decode_rows(engines[name], caches[name])) for name in names}
        state = {name: (list(positions), [5] * len(positions)) for name in names}
        times = {name: Timer() for name in names}
        sampling, first = Timer(), {}
        for k in range(steps + 2):  # the first two warm (buffers grown, first-call costs paid)
            for name in (names if k % 2 == 0 else names[::-1]):
                pos, tokens = state[name]
                t0 = time.perf_counter()
                logits = steppers[name](tokens, pos)
                if k >= 2:
                    times[name].seconds.append(time.perf_counter() - t0)
                with sampling:
                    tokens = logits.argmax(-1).tolist()
                if k == 2:
                    first[name] = logits.clone()
                state[name] = ([p + 1 for p in pos], tokens)
    return {name: t.seconds for name, t in times.items()}, sampling.seconds, first


def split(prof, steps: int, total_ms: float) -> dict[str, float]:
    """ms per step in each record_function range, and "other" (the rest of the profiled step)."""
    names = ("attention", "mamba2", "gated_deltanet", "mlp", "lm_head", "embed+rope")
    out = {}
    for ev in prof.key_averages():
        if ev.key in names:
            out[ev.key] = ev.cpu_time_total / 1e3 / steps
    out["other"] = total_ms - sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a checkpoint directory or a registry name")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per stream")
    ap.add_argument("--reps", type=int, default=3, help="multiplies --steps (kept for the command lines in docs)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--split", action="store_true", help="also split one profiled run per path by layer kind")
    ap.add_argument("--kernel", nargs="+", default=[], choices=[k for k in DECODE_KERNELS if k != "torch"],
                    help="also run the lean step on these op tables (EngineConfig.decode_kernel)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    # One engine (and model copy) per path: the lean step makes the modules' weights views of its fused
    # ones, so the module path is measured on a model no step touched (weights as loaded).
    dtype = getattr(torch, args.dtype)
    engines = {kind: make_engine(str(path), dtype, max_running=max(args.streams), decode_step=kind) for kind in ("module", "lean")}
    for k in args.kernel:
        engines[f"lean+{k}"] = e = make_engine(str(path), dtype, max_running=max(args.streams), decode_step="lean",
                                               decode_kernel=k)
        if e.runner.decode_kernel != k:
            sys.exit(f"kernel {k} is not available here (see the warning above)")
    engine = engines["module"]
    if engines["lean"].runner.decode_kernel is None:
        sys.exit(f"{path.name}: the lean step does not cover this model; nothing to compare")
    wbytes = weight_bytes(engine.model)
    bw_sum, bw_copy = bandwidth()  # best of 5; a busy machine reads slower, so the floor is then too high
    floor_ms = 1e3 * wbytes / (bw_sum * 1e9)
    params = sum(p.numel() for p in engine.model.parameters()) / 1e6
    print(f"model: {path.name} ({params:.1f}M parameters, {args.dtype}), CPU, {args.threads} torch thread(s); "
          f"context {args.context} tokens per stream, {args.steps * args.reps} steps per path in lockstep; "
          f"load average at start {load_average()}")
    print(f"bandwidth: sum {bw_sum:.1f} GB/s, copy {bw_copy:.1f} GB/s (read + write); weights read per step "
          f"{wbytes / 1e6:.0f} MB -> floor {floor_ms:.1f} ms per step")
    print()
    print("| streams | module ms/step | lean ms/step | lean speedup | module ms/token | lean ms/token | "
          "module tok/s | lean tok/s | floor ms/step | lean / floor | sampling ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    splits, kernel_rows = {}, []
    for b in args.streams:
        prompts = [GenerationRequest((tuple(torch.randint(10, vocab, (args.context,), generator=gen).tolist()),), mode="full")
                   for _ in range(b)]
        pre = {kind: [e.prefill(r) for r in prompts] for kind, e in engines.items()}
        caches = {kind: [p.cache for p in ps] for kind, ps in pre.items()}
        positions = [p.position for p in pre["module"]]
        got, samp, first = lockstep(engines, caches, positions, args.steps * args.reps)
        m, ln = (1e3 * statistics.median(got[k]) for k in ("module", "lean"))
        print(f"| {b} | {m:.1f} | {ln:.1f} | {m / ln:.2f}x | {m / b:.1f} | {ln / b:.1f} | {1e3 * b / m:.1f} | "
              f"{1e3 * b / ln:.1f} | {floor_ms:.1f} | {ln / floor_ms:.2f}x | {1e3 * statistics.median(samp):.2f} |",
              flush=True)
        for k in args.kernel:
            kn = 1e3 * statistics.median(got[f"lean+{k}"])
            err = (first[f"lean+{k}"] - first["lean"]).abs().max().item()
            kernel_rows.append(f"| {b} | {k} | {ln:.1f} | {kn:.1f} | {ln / kn:.2f}x | {m / kn:.2f}x | {kn / b:.1f} | "
                               f"{1e3 * b / kn:.1f} | {kn / floor_ms:.2f}x | {err:.1e} |")
        if args.split and b in (args.streams[0], args.streams[-1]):
            for name in ("module", "lean", *(f"lean+{k}" for k in args.kernel)):
                hooks = ModuleRanges(engine.model, engine.adapter) if name == "module" else None
                try:
                    times, prof = run(engines[name], caches[name], positions, min(args.steps, 8), profile=True)
                finally:
                    if hooks is not None:
                        hooks.remove()
                splits[(b, name)] = split(prof, len(times), 1e3 * sum(times) / len(times))
    print(f"load average at end {load_average()}")
    if kernel_rows:
        print()
        print("the lean step on the native op tables (runner/ops.py NativeOps), same lockstep runs; max |logit "
              "difference| from the lean step on torch's ops at the first timed step:")
        print("| streams | kernel | lean ms/step | kernel ms/step | kernel vs lean | kernel vs module | kernel ms/token | "
              "kernel tok/s | kernel / floor | max logit diff |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        print("\n".join(kernel_rows))
    if splits:
        kinds = ["attention", "mamba2", "gated_deltanet", "mlp", "lm_head", "embed+rope", "other"]
        kinds = [k for k in kinds if any(k in s for s in splits.values())]
        print()
        print("profiled step split, ms per step (profiler overhead included; the module path's norms count with "
              "their mixer / MLP, the lean step's embedding and rotary are 'embed+rope')")
        print("| streams | path | " + " | ".join(kinds) + " | profiled total |")
        print("|---:|---|" + "---:|" * (len(kinds) + 1))
        for (b, name), s in splits.items():
            print(f"| {b} | {name} | " + " | ".join(f"{s.get(k, 0.0):.1f}" for k in kinds)
                  + f" | {sum(s.values()):.1f} |")


if __name__ == "__main__":
    main()
