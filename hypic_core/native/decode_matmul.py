"""Decode-sized matmuls on the CPU: y [R, out] = x [R, in] @ W^T (+ bias) for a few rows R, W [out, in],
and the decode step's other ops, in native kernels (hypic_core/native/*.cpp).

A decode step reads every weight once for R = 1..8 rows (streams), so its matmuls are bound by the
bytes they read. `NativeMatmul.linear` takes W as:

- fp32: exact up to summation order;
- fp16 (`w.half()`) or bf16 (`to_bf16(w)`): half the bytes, the weights rounded (lossy), widened to
  fp32 exactly in the kernel; the activations and sums stay fp32, except bf16 on the avx512bf16 variant
  (vdpbf16ps: the activations rounded to bf16 as well, 32 at a time; sums fp32);
- int8 with one fp32 scale per output row (`quantize_int8`: symmetric, max |w| -> 127): a quarter of the
  bytes, lossier still; or with one scale per group of `Q8_GROUP` consecutive weights of a row
  (`quantize_int8(w, group=Q8_GROUP)`, scales [out, in / 32]: llama.cpp's Q8_0 layout): 12% more bytes
  than per-row, each group's largest weight at 127.

The same library holds the step's other fp32 ops (`add_rmsnorm`, `silu_mul`, `attend`, `mamba2`), each
one call where torch ran 5-30 small ops; tests/engine/test_decode_ops.py holds each to the torch code it
replaces, and `reference` is the plain torch product the matmul tests compare with.

The library is built once per ISA variant (hypic_core/native/library.py: avx512bf16, avx512, avx2, generic; the best
one the CPU's flags allow is picked) into `library.cache_dir()` (or a directory built ahead of time by
`python -m hypic_core.native build`), checked (owner, mode, no symlinks, size, ELF header,
sha256 against its manifest) and loaded from the checked bytes. `native()` returns None, with the
reason logged once as a warning, when no variant can be built or loaded (no compiler and nothing
prebuilt, an untrusted directory, missing symbols); the caller then runs torch's ops.
`kernel_status()` says which variant runs, from where, with which digest, or why none does
(/health shows it). `HYPIC_KERNEL_VARIANT` pins a variant instead of the best (`pinned_variant()`).

Public: `NativeMatmul` (linear, add_rmsnorm, silu_mul, attend, mamba2; the blocks mlp_block, norm_linear,
mamba2_block, attention_block, each a layer's part in one call; `variant`, `sha256`, `path`),
`native()`, `build()`, `kernel_status()`, `pinned_variant()`, `reference()`, `quantize_int8()`, `dequantize_int8()`, `Q8_GROUP`, `to_bf16()`, `cpu_reason()`.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from . import library

log = logging.getLogger("hypic.decode_matmul")

Q8_GROUP = 32  # hypic_kernels.h HYPIC_Q8_GROUP: weights per scale of group-scaled int8


def cpu_reason(variant: str | None = None) -> str | None:
    """Why this CPU cannot run `variant` (default: the best it can; `generic` runs anywhere). None: it can."""
    v = library.BY_NAME[variant] if variant else library.pick()
    missing = library.missing_flags(v)
    return f"the CPU lacks {', '.join(missing)} (kernel variant {v.name})" if missing else None


class NativeMatmul:
    """A loaded kernel library (`library.load`: checked, its symbols typed): `linear(x, w, bias)` for fp32
    x [R, in] (contiguous) and W [out, in] (fp32, fp16, bf16 or int8, contiguous) on the CPU returns a new
    fp32 [R, out]; runs on torch's thread count."""

    def __init__(self, loaded: library.Loaded):
        self.path, self.variant, self.sha256, self.lib = loaded.path, loaded.variant, loaded.sha256, loaded.lib
        self._fns = {torch.float32: self.lib.hypic_linear_f32, torch.float16: self.lib.hypic_linear_f16,
                     torch.bfloat16: self.lib.hypic_linear_bf16}

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               scales: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T * scales (+ bias): W fp32, fp16 or bf16, or int8 with its rows' fp32 `scales` [out] or its
        groups' [out, in / Q8_GROUP] (in a multiple of Q8_GROUP)."""
        R, n = x.shape
        out = w.shape[0]
        if (x.dtype != torch.float32 or (w.dtype not in self._fns and w.dtype != torch.int8) or w.shape[1] != n
                or x.device.type != "cpu" or not (w.is_contiguous() and x.is_contiguous())):
            raise ValueError(f"linear needs contiguous fp32 x [R, {w.shape[1]}] and fp32/fp16/bf16/int8 W [out, in] on the "
                             f"CPU; got x {x.dtype} {tuple(x.shape)}, W {w.dtype} {tuple(w.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous fp32 [{out}], got {bias.dtype} {tuple(bias.shape)}")
        _check_scales(w, scales)
        y = torch.empty(R, out, dtype=torch.float32)
        b = bias.data_ptr() if bias is not None else None
        if scales is not None:
            fn = self.lib.hypic_linear_i8 if scales.dim() == 1 else self.lib.hypic_linear_q8
            fn(x.data_ptr(), w.data_ptr(), scales.data_ptr(), b, y.data_ptr(), R, n, out, torch.get_num_threads())
        else:
            self._fns[w.dtype](x.data_ptr(), w.data_ptr(), b, y.data_ptr(), R, n, out, torch.get_num_threads())
        return y


    # --- the step's other ops (fp32, contiguous; the lean step checks what it passes once, at build) ---
    def add_rmsnorm(self, h: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """h [R, n] += d (in place, when d is given); returns w * h / sqrt(mean(h^2) + eps), a new [R, n]."""
        out = torch.empty_like(h)
        self.lib.hypic_add_rmsnorm(h.data_ptr(), None if d is None else d.data_ptr(), w.data_ptr(), eps, out.data_ptr(),
                                   h.shape[0], h.shape[1])
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gu[:, :n]) * gu[:, n:] for gu [R, 2n]: a new [R, n]."""
        R, n = gu.shape[0], gu.shape[1] // 2
        out = torch.empty(R, n, dtype=torch.float32)
        self.lib.hypic_silu_mul(gu.data_ptr(), out.data_ptr(), R, n)
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
               lens: torch.Tensor, scale: float, cos: torch.Tensor | None = None,
               sin: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """B query tokens, each of buffer row rows[b] (None: row b): q [B, H, D] and the new k [B, Hkv, D]
        rotated by cos / sin [B, rot] (rotate-half RoPE on their first rot dims; none when cos is None), k
        and v written at column lens[b] - 1 of their rows of the buffers kb / vb [rows, Hkv, cols, D]
        (contiguous), then query b attends to its row's first lens[b] columns (softmax(q K^T * scale) V,
        grouped heads): several tokens of one row with consecutive lengths attend causally. q is not
        changed. Returns [B, H * D]."""
        B, H, D = q.shape
        if q.dtype != torch.float32:
            raise ValueError("attend needs fp32 queries and contiguous fp32 K/V row buffers")
        _check_attend(kb, vb, lens, rows, B)
        out = torch.empty(B, H * D, dtype=torch.float32)
        rot = 0 if cos is None else cos.shape[-1]
        bad = self.lib.hypic_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), kb.data_ptr(), vb.data_ptr(),
                                    lens.data_ptr(), None if rows is None else rows.data_ptr(),
                                    None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), rot,
                                    out.data_ptr(), B, H, k.shape[1], D, kb.stride(0), kb.stride(1), kb.shape[0],
                                    kb.shape[2], scale, torch.get_num_threads())
        if bad:  # checked in the kernel before it writes: out of the buffers is an error, not memory
            raise _outside(kb)
        return out

    def mamba2(self, zx: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
               dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, state: torch.Tensor, norm_w: torch.Tensor,
               eps: float, heads: int, head_dim: int, groups: int, state_size: int) -> torch.Tensor:
        """Bamba's Mamba2 mixer on one token per row after its in_proj (zx [B, gate | xBC | dt]): the conv rows
        [B, C, K] and state rows [B, H, P, N] (fp32) advance in place; returns the gated, group-normed
        output [B, H * P] for out_proj."""
        B = zx.shape[0]
        _check_states(conv, state)
        out = torch.empty(B, heads * head_dim, dtype=torch.float32)
        self.lib.hypic_mamba2(zx.data_ptr(), conv.data_ptr(), conv_w.data_ptr(),
                              None if conv_b is None else conv_b.data_ptr(), dt_bias.data_ptr(), A.data_ptr(),
                              D.data_ptr(), state.data_ptr(), norm_w.data_ptr(), eps, out.data_ptr(),
                              B, heads, head_dim, groups, state_size, conv.shape[-1], torch.get_num_threads())
        return out


    # --- blocks (blocks.cpp): a layer's part from the residual stream in one call (h += d, rmsnorm, the part).
    # A weight is any (w, bias, scales) record (runner/ops.py `Linear`); a block's weights share one type. ---
    def mlp_block(self, h: torch.Tensor, d: torch.Tensor | None, norm_w: torch.Tensor, eps: float, gate_up, down) -> torch.Tensor:
        """h [R, n] += d (in place); returns down(silu(gate(x)) * up(x)) [R, n] for x = rmsnorm(h) * norm_w."""
        R, n = h.shape
        out = torch.empty(R, n, dtype=torch.float32)
        self.lib.hypic_mlp_block(h.data_ptr(), _ptr(d), norm_w.data_ptr(), eps, *_weight(gate_up), *_weight(down),
                                 _wtype(gate_up), out.data_ptr(), R, n, gate_up.w.shape[0] // 2,
                                 torch.get_num_threads())
        return out

    def norm_linear(self, h: torch.Tensor, d: torch.Tensor | None, norm_w: torch.Tensor, eps: float, w) -> torch.Tensor:
        """h [R, n] += d (in place); returns W x [R, out] for x = rmsnorm(h) * norm_w."""
        R, n = h.shape
        out = torch.empty(R, w.w.shape[0], dtype=torch.float32)
        self.lib.hypic_norm_linear(h.data_ptr(), _ptr(d), norm_w.data_ptr(), eps, *_weight(w), _wtype(w),
                                   out.data_ptr(), R, n, w.w.shape[0], torch.get_num_threads())
        return out

    def mamba2_block(self, h: torch.Tensor, d: torch.Tensor | None, norm_w: torch.Tensor, eps: float, in_proj, out_proj,
                     conv: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, dt_bias: torch.Tensor,
                     A: torch.Tensor, D: torch.Tensor, state: torch.Tensor, gnorm_w: torch.Tensor, gnorm_eps: float,
                     heads: int, head_dim: int, groups: int, state_size: int) -> torch.Tensor:
        """h [R, n] += d (in place); returns out_proj(`mamba2`(in_proj(x))) [R, n] for x = rmsnorm(h) * norm_w,
        one token per row, the conv and state rows advanced in place."""
        R, n = h.shape
        _check_states(conv, state)
        out = torch.empty(R, n, dtype=torch.float32)
        self.lib.hypic_mamba2_block(h.data_ptr(), _ptr(d), norm_w.data_ptr(), eps, *_weight(in_proj), *_weight(out_proj),
                                    _wtype(in_proj), in_proj.w.shape[0], conv.data_ptr(), conv_w.data_ptr(),
                                    _ptr(conv_b), dt_bias.data_ptr(), A.data_ptr(), D.data_ptr(), state.data_ptr(),
                                    gnorm_w.data_ptr(), gnorm_eps, out.data_ptr(), R, n, heads, head_dim, groups,
                                    state_size, conv.shape[-1], torch.get_num_threads())
        return out

    def attention_block(self, h: torch.Tensor, d: torch.Tensor | None, norm_w: torch.Tensor, eps: float, qkv, o,
                        kb: torch.Tensor, vb: torch.Tensor, lens: torch.Tensor, scale: float, heads: int, kv_heads: int,
                        head_dim: int, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
        """h [R, n] += d (in place); returns o(`attend`(q, k, v)) [R, n] with q | k | v = qkv(x) for
        x = rmsnorm(h) * norm_w (a plain attention: no output gate, no q / k norms). Raises ValueError, with
        nothing written, for a length or row outside the buffers."""
        R, n = h.shape
        _check_attend(kb, vb, lens, rows, R)
        out = torch.empty(R, n, dtype=torch.float32)
        rot = 0 if cos is None else cos.shape[-1]
        bad = self.lib.hypic_attention_block(h.data_ptr(), _ptr(d), norm_w.data_ptr(), eps, *_weight(qkv), *_weight(o),
                                             _wtype(qkv), kb.data_ptr(), vb.data_ptr(), lens.data_ptr(), _ptr(rows),
                                             _ptr(cos), _ptr(sin), rot, out.data_ptr(), R, n, heads, kv_heads, head_dim,
                                             kb.stride(0), kb.stride(1), kb.shape[0], kb.shape[2], scale,
                                             torch.get_num_threads())
        if bad:
            raise _outside(kb)
        return out


_WTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}  # hypic_kernels.h HYPIC_W_*
HYPIC_W_Q8 = 4


def _wtype(w) -> int:
    """A block weight's type code: its dtype's, or group-scaled int8 (2-D scales)."""
    return HYPIC_W_Q8 if w.scales is not None and w.scales.dim() == 2 else _WTYPE[w.w.dtype]


def _check_scales(w: torch.Tensor, scales: torch.Tensor | None) -> None:
    """int8 weights [out, in] take fp32 scales, per row [out] or per group [out, in / Q8_GROUP]; no other weight does."""
    out, n = w.shape
    if (w.dtype == torch.int8) != (scales is not None):
        raise ValueError("int8 weights need their fp32 scales, and only they take scales")
    if scales is None:
        return
    rows = scales.shape == (out,)
    groups = n % Q8_GROUP == 0 and scales.shape == (out, n // Q8_GROUP)
    if scales.dtype != torch.float32 or not scales.is_contiguous() or not (rows or groups):
        raise ValueError(f"int8 scales must be contiguous fp32, per row [{out}] or per group of {Q8_GROUP} "
                         f"[{out}, {n // Q8_GROUP}] (in = {n} a multiple of {Q8_GROUP}); got {scales.dtype} {tuple(scales.shape)}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_attend(kb: torch.Tensor, vb: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor | None, n: int) -> None:
    """What `attend` and `attention_block` need of the K/V buffers and of the `n` queries' lengths and rows."""
    if not (kb.is_contiguous() and vb.is_contiguous() and kb.dtype == vb.dtype == torch.float32):
        raise ValueError("attend needs fp32 queries and contiguous fp32 K/V row buffers")
    if lens.dtype != torch.long or len(lens) != n or (rows is not None and (rows.dtype != torch.long or len(rows) != n)):
        raise ValueError("attend needs one long length (and row) per query")


def _outside(kb: torch.Tensor) -> ValueError:
    """The error of a query whose length or row the kernel found outside the buffers (nothing written)."""
    return ValueError(f"attend: lengths 1..{kb.shape[2]} and rows 0..{kb.shape[0] - 1} of the buffers, one each per query")


def _check_states(conv: torch.Tensor, state: torch.Tensor) -> None:
    if not (conv.is_contiguous() and state.is_contiguous() and conv.dtype == state.dtype == torch.float32):
        raise ValueError("mamba2 needs contiguous fp32 conv and state rows")


def _weight(w) -> tuple[int, int | None, int | None]:
    """A block's weight arguments: (w, its int8 scales, bias) as pointers (NativeOps built them right, once)."""
    return w.w.data_ptr(), _ptr(w.scales), _ptr(w.bias)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of W [out, in]: (q int8 [out, in], fp32 scales) with W ~ q * scales, each row's (or, with
    `group`, each run of `group` consecutive weights of a row) largest |w| at 127. Scales [out] per row, or
    [out, in / group] (in a multiple of `group`)."""
    w = w.detach().float()
    out, n = w.shape
    if group is not None and (group < 1 or n % group):
        raise ValueError(f"group must divide the row length {n}, got {group}")
    g = w.reshape(out, n // group, group) if group else w.unsqueeze(1)
    scales = (g.abs().amax(dim=2) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(g / scales[..., None]).clamp_(-127, 127).to(torch.int8).reshape(out, n)
    return q.contiguous(), (scales if group else scales[:, 0]).contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weights int8 `q` [out, in] with per-row [out] or per-group [out, in / group] `scales` stand for."""
    if scales.dim() == 1:
        return q.float() * scales[:, None]
    return q.float() * scales.repeat_interleave(q.shape[1] // scales.shape[1], dim=1)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch product the kernels compute: x @ (W.float() * scales)^T (+ bias), fp32."""
    w = w.float() if scales is None else dequantize_int8(w, scales)
    return torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())


def to_bf16(w: torch.Tensor) -> torch.Tensor:
    """W [out, in] as contiguous bf16 (round to nearest even), the `linear` weight of native-bf16."""
    return w.detach().to(torch.bfloat16).contiguous()


_lock = threading.Lock()
_built: dict[str, NativeMatmul | str] = {}  # compiler name -> this process's kernels, or why there are none


def _compiler() -> str | None:
    return library.find_compiler()


def build(compiler: str | None = None, directory: Path | None = None, variant: str | None = None) -> NativeMatmul:
    """Load the kernels of `variant` (default: the best this CPU runs) from `directory` (default
    `library.cache_dir()`), building them first with `compiler` when they are missing or failed their check
    (then one warning says what failed). Raises RuntimeError with the reason when it cannot."""
    v = library.BY_NAME.get(variant or library.pick().name)
    if v is None:
        raise RuntimeError(f"unknown kernel variant {variant!r}; one of {', '.join(library.BY_NAME)}")
    if (reason := cpu_reason(v.name)) is not None:
        raise RuntimeError(reason)
    root = Path(directory) if directory is not None else library.cache_dir()
    try:
        return NativeMatmul(library.load(root, v))
    except library.Untrusted as exc:
        failed = None if exc.missing else f"the kernel library in {root} failed its check ({exc})"
    compiler = compiler or _compiler()
    if compiler is None or shutil.which(compiler) is None:
        raise RuntimeError("; ".join(filter(None, [failed, f"no C++ compiler found ({compiler or 'set CXX, or install g++'})"
                                                            " to build the kernels"])))
    log.info("compiling the decode kernels (variant %s, %s, once) into %s", v.name, os.path.basename(compiler), root)
    try:
        library.build(root, v, compiler)
        kernels = NativeMatmul(library.load(root, v))
    except library.Untrusted as exc:
        raise RuntimeError("; ".join(filter(None, [failed, f"not built: {exc}"]))) from exc
    if failed:
        log.warning("%s: never loaded, rebuilt from source", failed)
    return kernels


VARIANT_ENV = "HYPIC_KERNEL_VARIANT"


def pinned_variant() -> str | None:
    """The variant $HYPIC_KERNEL_VARIANT pins (one of `library.BY_NAME`), or None: the best this CPU runs.
    Pinning one variant on every replica makes the decode step's native sums run in the same order on CPUs
    of different widths; it also measures a narrower build (avx2, generic) on a wider CPU."""
    return os.environ.get(VARIANT_ENV, "").strip() or None


def native(compiler: str | None = None) -> NativeMatmul | None:
    """The kernels of this process (built or loaded on first use; the variant `pinned_variant()`, else the
    best this CPU runs), or None when they cannot be had here: the reason is then logged once as a warning
    and the caller runs torch's ops instead. Never raises."""
    variant = pinned_variant()
    name = (compiler or _compiler() or "") + ("@" + variant if variant else "")
    with _lock:
        if name not in _built:
            try:
                if variant is not None and variant not in library.BY_NAME:
                    raise RuntimeError(f"{VARIANT_ENV}={variant!r} names no kernel variant; one of {', '.join(library.BY_NAME)}")
                _built[name] = got = build(compiler, variant=variant)
                log.info("decode kernels: variant %s (sha256 %s) from %s", got.variant, got.sha256[:16], got.path)
            except Exception as exc:  # noqa: BLE001 - whatever fails (OSError, a missing symbol), torch runs
                log.warning("decode kernels unavailable, torch's ops run instead: %s", exc)
                _built[name] = str(exc) or type(exc).__name__
        got = _built[name]
    return got if isinstance(got, NativeMatmul) else None


def kernel_status() -> dict:
    """What /health shows: {"state": "loaded" | "unavailable" | "loading" | "not loaded", "variant",
    "best_variant", "pinned" ($HYPIC_KERNEL_VARIANT or None), "library", "sha256", "reason"} for this process's kernels (`native()`); "not loaded"
    until a decode step asks for them. Never waits: a build in progress (holding the lock) reads as
    "loading"."""
    got = list(_built.values())  # a snapshot under the GIL; _lock may be held by a build for seconds
    kernels = next((k for k in got if isinstance(k, NativeMatmul)), None)
    status = {"state": "not loaded", "variant": None, "best_variant": library.pick().name, "pinned": pinned_variant(),
              "library": None, "sha256": None, "reason": None}
    if kernels is not None:
        status.update(state="loaded", variant=kernels.variant, library=str(kernels.path), sha256=kernels.sha256)
    elif got:
        status.update(state="unavailable", reason=got[-1])
    elif _lock.locked():
        status.update(state="loading")
    return status
