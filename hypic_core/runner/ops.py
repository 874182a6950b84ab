"""The op table the lean decode step (runner/decode_step.py) and its verification forward
(runner/verify_step.py) compute with, chosen once when the step is built by `ops_for(kernel, model)`
(EngineConfig.decode_kernel, HYPIC_DECODE_KERNEL): past it no kernel or precision name is read.

- `TorchOps`, the reference: torch's kernels; fused weights kept transposed [in, out] (x @ W ran
  1.5-2x faster than x @ W^T for 1-2 rows with torch's MKL, docs/benchmarks.md), attention as
  grouped matmuls under a mask, norms, gates and the Mamba2 update as torch code.
- `NativeOps`: native/decode_matmul.py's `NativeMatmul` on an fp32 model on the CPU: weights kept
  [out, in] (the modules' own rows, or an fp16 / bf16 / int8 copy), each residual add fused with the
  norm after it, the MLP's gate, an attention layer's rotary + K/V write + attention, a Mamba2 mixer
  between its projections: one native call each; and a layer's MLP, Mamba2 mixer or plain attention
  from the residual stream (add, norm, projections, the op between) as one call (the blocks).

tests/engine/test_decode_ops.py holds every `NativeOps` op to `TorchOps`'; test_decode_step.py the
step on `TorchOps` to the HF modules.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..native import decode_matmul
from ..native.decode_matmul import Q8_GROUP, quantize_int8

log = logging.getLogger("hypic.decode_step")

# Rows up to which an fp32 weight runs the native kernel; more rows (a verification forward of several
# rows' drafts) run torch's GEMM on the same [out, in] weight, which is faster there.
NATIVE_ROWS = 16


class Linear(NamedTuple):
    """A fused weight as its ops keep it: `w` (TorchOps: the model's dtype, [in, out]; NativeOps: [out, in],
    fp32, fp16, bf16 or int8), `bias` (or None) and, for int8, its fp32 `scales` (per row [out], or per
    group of Q8_GROUP weights [out, in / Q8_GROUP])."""

    w: torch.Tensor
    bias: torch.Tensor | None
    scales: torch.Tensor | None = None


def fuse(linears: Sequence[torch.nn.Linear], transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and one bias) for several linears on the same input, each module's parameters made
    views of it (same numbers, one copy in memory): [in, sum of outs] when `transposed` (each module's
    weight the transpose of a column block: the modules compute the same product from the same
    bytes), else [sum of outs, in] (each module's weight a block of its rows)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    weight = weight.t().contiguous() if transposed else weight.contiguous()
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                          for m in linears])
    at = 0
    for m in linears:
        n = m.out_features
        m.weight.data = weight[:, at:at + n].t() if transposed else weight[at:at + n]
        if m.bias is not None:
            m.bias.data = bias[at:at + n]
        at += n
    return weight, bias


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [N, heads, D] on its first cos.shape[-1] dims; cos/sin [N, 1, rot]."""
    rot = cos.shape[-1]
    r = x[..., :rot]
    half = rot // 2
    out = r * cos + torch.cat([-r[..., half:], r[..., :half]], dim=-1) * sin
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


class Rows:
    """One forward's tokens on a `DecodeBatch`'s rows: row r is fed `counts[r]` tokens (the decode step:
    one each; a verification: its last token and its draft), written at its columns lengths[r]..
    Token i (flat, row by row) is of buffer row `row[i]` and writes column `col[i]`; `cos` / `sin`
    [N, rot] are the tokens' rotary (None without). The ops read what they need off it."""

    def __init__(self, batch, counts: Sequence[int], cos: torch.Tensor | None, sin: torch.Tensor | None):
        self.batch = batch
        self.b, self.counts, self.lengths = len(counts), list(counts), list(batch.lengths)
        self.single = max(counts) == 1  # one token per row: the decode step
        self.cos, self.sin = cos, sin
        # TorchOps.prepare: where the tokens write, on the device (`same`: one column for all, one token per row)
        self.same = self.row_dev = self.col_dev = None
        dev = cos.device if cos is not None else batch.model.device
        self.device = dev
        if self.single:
            self.col = torch.tensor(self.lengths, dtype=torch.long)
            self.row = None  # token i is of row i
        else:
            self.row = torch.repeat_interleave(torch.arange(self.b), torch.tensor(self.counts))
            self.col = torch.tensor([n + t for n, c in zip(self.lengths, self.counts) for t in range(c)], dtype=torch.long)
        self.lens = self.col + 1  # the columns token i sees (its own included)


@functools.lru_cache(maxsize=64)
def _causal(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, n] additive mask: token t of a row's new tokens sees the new tokens up to itself."""
    return torch.full((n, n), float("-inf"), dtype=dtype, device=device).triu_(1)


class TorchOps:
    """The reference op table: torch's kernels, on any dtype and device."""

    name = "torch"

    def linear_weight(self, linears: Sequence[torch.nn.Linear]) -> Linear:
        return Linear(*fuse(linears, transposed=True))

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        """x [N, in] @ W (+ bias)."""
        return torch.mm(x, w.w) if w.bias is None else torch.addmm(w.bias, x, w.w)

    def add_rmsnorm(self, h: torch.Tensor, d: torch.Tensor | None, norm) -> torch.Tensor:
        """h += d in place (when d is given); returns `norm(h)`."""
        if d is not None:
            h.add_(d)
        return norm(h)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gu[:, :n]) * gu[:, n:] for gu [N, 2n]."""
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    def prepare(self, rows: Rows) -> Rows:
        """What attention reads off `rows`, once per forward: cos / sin [N, 1, rot]; for one token per row
        the column each row writes (`same`: one for all, or `rows.col` through a mask hiding each row's
        unused columns, `bias` [B, 1, 1, width])."""
        if rows.cos is not None:
            rows.cos3, rows.sin3 = rows.cos[:, None], rows.sin[:, None]
        if rows.single:
            rows.width = max(rows.lengths) + 1
            rows.same = rows.lengths[0] if min(rows.lengths) == rows.width - 1 else None
            rows.bias = None
            if rows.same is None:
                dev = rows.device
                rows.col_dev, rows.row_dev = rows.col.to(dev), torch.arange(rows.b, device=dev)
                hide = torch.arange(rows.width, device=dev)[None, :] > rows.col_dev[:, None]
                rows.bias = torch.zeros(hide.shape, dtype=rows.batch.model.dtype, device=dev).masked_fill_(
                    hide, float("-inf"))[:, None, None, :]
        else:
            rows.row_dev, rows.col_dev = rows.row.to(rows.device), rows.col.to(rows.device)
        return rows

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv, rows: Rows, scale: float) -> torch.Tensor:
        """q [N, H, D], k and v [N, Hkv, D] of the tokens `rows` describes: q and k rotated, k and v written
        into the layer's K/V row buffers `kv` at each token's column, then each token's attention over its
        row's columns up to its own (grouped heads). Returns [N, H * D]."""
        N, H, D = q.shape
        Hkv = k.shape[1]
        if rows.cos is not None:
            q, k = rope(q, rows.cos3, rows.sin3), rope(k, rows.cos3, rows.sin3)
        kv.write(k, v, rows.row_dev, rows.col_dev, rows.same)
        kb, vb = kv.keys, kv.values
        if rows.single:  # one batched product over the live columns, a mask where rows differ in length
            keys, values = kb[:N, :, :rows.width], vb[:N, :, :rows.width]
            scores = torch.matmul(q.view(N, Hkv, H // Hkv, D), keys.transpose(-1, -2)) * scale  # [N, Hkv, G, W]
            if rows.bias is not None:
                scores = scores + rows.bias
            return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values).reshape(N, H * D)
        # Several tokens a row: row by row, each over its own live columns as they lie in the buffers (no
        # padding to the longest row or draft: with long contexts that cost more than the drafts saved).
        G, outs, at = H // Hkv, [], 0
        for r, (n, L) in enumerate(zip(rows.counts, rows.lengths)):
            W = L + n
            qr = q[at:at + n].view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
            scores = torch.matmul(qr, kb[r, :, :W].transpose(-1, -2)) * scale  # [Hkv, G*n, W]
            if n > 1:  # a row's new tokens see each other causally
                scores = scores.view(Hkv, G, n, W)
                scores[..., L:] += _causal(n, scores.dtype, scores.device)
                scores = scores.view(Hkv, G * n, W)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            outs.append(torch.matmul(probs, vb[r, :, :W]).view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H * D))
            at += n
        return torch.cat(outs)

    # How a verification forward runs Mamba2's tokens (decode_step.Mamba2.verify): in closed form (a few
    # batched torch ops for all of them) or stepped through `mamba2` one token at a time (NativeOps, whose
    # one-token update is a single call, and which then verifies with the plain step's own arithmetic).
    stepped_verify = False

    def mamba2(self, mixer, zx: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """A Mamba2 mixer between its projections, one token per row: its own torch code (`between`)."""
        return mixer.between(zx, conv, state)

    # --- blocks: a layer's part from the residual stream h: h += d (in place), x = norm(h), the part on x.
    # Here the ops above, composed (the reference); NativeOps runs each as one call. ---
    def mlp_block(self, h: torch.Tensor, d: torch.Tensor | None, norm, mlp) -> torch.Tensor:
        """`mlp` (decode_step.MLP: gate_up, down) on norm(h + d): down(silu(gate) * up)."""
        return self.linear(self.silu_mul(self.linear(self.add_rmsnorm(h, d, norm), mlp.gate_up)), mlp.down)

    def norm_linear(self, h: torch.Tensor, d: torch.Tensor | None, norm, w: Linear) -> torch.Tensor:
        """W norm(h + d) (the lm_head after the final norm)."""
        return self.linear(self.add_rmsnorm(h, d, norm), w)

    def mamba2_block(self, h: torch.Tensor, d: torch.Tensor | None, norm, mixer, conv: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
        """A Mamba2 mixer (decode_step.Mamba2) on norm(h + d), one token per row, its conv and state rows advanced."""
        x = self.add_rmsnorm(h, d, norm)
        return self.linear(self.mamba2(mixer, self.linear(x, mixer.in_proj), conv, state), mixer.out_proj)

    def attention_block(self, h: torch.Tensor, d: torch.Tensor | None, norm, attn, rows: Rows) -> torch.Tensor:
        """An attention layer (decode_step.Attention) on norm(h + d), its K/V written."""
        return attn(self.add_rmsnorm(h, d, norm), rows, self)


class NativeOps(TorchOps):
    """The native kernels (`decode_matmul.NativeMatmul`) on an fp32 model on the CPU; matmuls on fp32
    weights or an fp16 / bf16 / int8 copy of them (`weights`: torch.float32, float16, bfloat16 or int8;
    int8 with one scale per row, or per `group` consecutive weights of a row: group=Q8_GROUP)."""

    def __init__(self, native, weights: torch.dtype = torch.float32, name: str = "native", group: int | None = None):
        if weights not in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
            raise ValueError(f"native weights must be float32, float16, bfloat16 or int8, got {weights}")
        if group not in (None, Q8_GROUP) or (group and weights != torch.int8):
            raise ValueError(f"group scales are int8's, of {Q8_GROUP} weights; got group={group} for {weights}")
        self.native, self.weights, self.name, self.group = native, weights, name, group

    def linear_weight(self, linears: Sequence[torch.nn.Linear]) -> Linear:
        weight, bias = fuse(linears, transposed=False)
        if self.weights == torch.int8:
            # a row length that is no multiple of the group keeps one scale per row
            group = self.group if self.group and weight.shape[1] % self.group == 0 else None
            q, scales = quantize_int8(weight, group)
            return Linear(q, bias, scales)
        return Linear(weight.to(self.weights).contiguous() if self.weights != torch.float32 else weight, bias)

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        """x [N, in] @ W^T (+ bias) on the native kernel; fp32 weights past NATIVE_ROWS rows on torch's GEMM."""
        if w.w.dtype == torch.float32 and x.shape[0] > NATIVE_ROWS:
            return F.linear(x, w.w, w.bias)
        return self.native.linear(x.contiguous(), w.w, w.bias, w.scales)

    def add_rmsnorm(self, h: torch.Tensor, d: torch.Tensor | None, norm) -> torch.Tensor:
        return self.native.add_rmsnorm(h, d, norm.native_weight, norm.eps)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return self.native.silu_mul(gu)

    def prepare(self, rows: Rows) -> Rows:
        if rows.cos is not None:
            rows.cos, rows.sin = rows.cos.contiguous(), rows.sin.contiguous()
        return rows

    def attend(self, q, k, v, kv, rows: Rows, scale: float) -> torch.Tensor:
        return self.native.attend(q.contiguous(), k.contiguous(), v.contiguous(), kv.keys, kv.values, rows.lens, scale,
                                  rows.cos, rows.sin, rows=rows.row)

    stepped_verify = True

    def mamba2(self, m, zx, conv, state) -> torch.Tensor:
        return self.native.mamba2(zx, conv, m.conv_w, m.conv_b, m.dt_bias, m.A, m.D, state, m.norm_w, m.norm_eps,
                                  m.H, m.P, m.G, m.N)

    # The blocks: one native call each (native/blocks.cpp: the ops above in the same order, so the same
    # numbers) where every matmul in it runs natively; else the composed ops (TorchOps').
    def _whole(self, rows: int) -> bool:
        return self.weights != torch.float32 or rows <= NATIVE_ROWS

    def mlp_block(self, h, d, norm, mlp) -> torch.Tensor:
        if not self._whole(h.shape[0]):
            return super().mlp_block(h, d, norm, mlp)
        return self.native.mlp_block(h, d, norm.native_weight, norm.eps, mlp.gate_up, mlp.down)

    def norm_linear(self, h, d, norm, w: Linear) -> torch.Tensor:
        if not self._whole(h.shape[0]):
            return super().norm_linear(h, d, norm, w)
        return self.native.norm_linear(h, d, norm.native_weight, norm.eps, w)

    def mamba2_block(self, h, d, norm, m, conv, state) -> torch.Tensor:
        if not self._whole(h.shape[0]):
            return super().mamba2_block(h, d, norm, m, conv, state)
        return self.native.mamba2_block(h, d, norm.native_weight, norm.eps, m.in_proj, m.out_proj, conv, m.conv_w,
                                        m.conv_b, m.dt_bias, m.A, m.D, state, m.norm_w, m.norm_eps, m.H, m.P, m.G, m.N)

    def attention_block(self, h, d, norm, attn, rows: Rows) -> torch.Tensor:
        if not (attn.plain and self._whole(h.shape[0])):
            return super().attention_block(h, d, norm, attn, rows)
        kv = rows.batch.attention_layer(attn.j)
        return self.native.attention_block(h, d, norm.native_weight, norm.eps, attn.qkv, attn.o, kv.keys, kv.values,
                                           rows.lens, attn.scale, attn.H, attn.Hkv, attn.D, rows.cos, rows.sin,
                                           rows=rows.row)


_NATIVE_WEIGHTS = {"native": (torch.float32, None), "native-f16": (torch.float16, None),
                   "native-bf16": (torch.bfloat16, None), "native-i8": (torch.int8, None), "native-q8": (torch.int8, Q8_GROUP)}


def ops_for(kernel: str, model: torch.nn.Module) -> TorchOps:
    """The op table for decode kernel `kernel` (config.DECODE_KERNELS) on `model`: `TorchOps` for "torch";
    `NativeOps` for "native" (fp32 weights), "native-f16" / "native-bf16" (an fp16 / bf16 copy: half the
    bytes, lossy) and
    "native-i8" / "native-q8" (an int8 copy, one scale per row / per 32 weights: a quarter of the bytes,
    lossier), on an fp32 model on the CPU
    where the kernels could be built; elsewhere `TorchOps`, and a warning says why."""
    if kernel != "torch" and kernel not in _NATIVE_WEIGHTS:
        raise ValueError(f"decode kernel must be one of torch, {', '.join(_NATIVE_WEIGHTS)}, got {kernel!r}")
    if kernel == "torch":
        return TorchOps()
    if model.dtype != torch.float32 or model.device.type != "cpu":
        log.warning("decode kernel %r runs fp32 models on the CPU; this one is %s on %s: torch's matmuls run",
                    kernel, model.dtype, model.device)
        return TorchOps()
    native = decode_matmul.native()  # None: the reason was logged
    weights, group = _NATIVE_WEIGHTS[kernel]
    return TorchOps() if native is None else NativeOps(native, weights, kernel, group)
