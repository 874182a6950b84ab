"""The decode step's op tables (hypic_core/runner/ops.py): `NativeOps` against `TorchOps`, its reference.

With `kernel="native"` the lean step runs its matmuls, norms, the MLP's gate, each attention layer
(rotary, the K/V write, the attention itself) and each Mamba2 mixer between its projections as
native calls (hypic_core/native/decode_matmul.py). Each op is checked here on its own against
`TorchOps`' (or the native kernel against the plain formula), on shapes with tails: rows of
different lengths, lengths across the kernel's blocks of 128 columns, head sizes off its fast
paths, grouped heads, partial rotary, several tokens a row (speculation's verification). The
whole step on each table is checked against the module path in test_decode_step.py (TorchOps) and
test_decode_kernels.py (NativeOps).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from types import SimpleNamespace

from hypic_core.native import decode_matmul
from hypic_core.runner.batch import KVRows
from hypic_core.runner.decode_step import Mamba2, Norm
from hypic_core.runner.ops import NativeOps, Rows, TorchOps, rope as _rope
from hypic_core.testing import tiny_model

NATIVE = decode_matmul.native()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="the native kernels cannot be built here (no compiler or no AVX2)")


@pytest.mark.parametrize("rows,n", [(1, 576), (3, 64), (2, 13)])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rmsnorm_equals_the_norm(rows, n, residual):
    g = torch.Generator().manual_seed(rows * n)
    h, d, w = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    norm = torch.nn.RMSNorm(n, eps=1e-5)
    norm.weight.data.copy_(w)
    want_h = h + d if residual else h.clone()
    got = NATIVE.add_rmsnorm(h, d if residual else None, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual added in place
    torch.testing.assert_close(got, Norm(norm)(want_h), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 1536), (4, 20)])
def test_silu_mul_equals_silu_times_up(rows, n):
    gu = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)) * 4
    gate, up = gu.split([n, n], dim=-1)
    torch.testing.assert_close(NATIVE.silu_mul(gu), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def attend_reference(q, k, v, kb, vb, lens, scale, cos=None, sin=None):
    """The lean step's torch attention, row by row: rotate, write the column, softmax(q K^T) V over the row's columns."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    if cos is not None:
        q, k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
    out = []
    for b in range(B):
        n = int(lens[b])
        kb[b, :, n - 1], vb[b, :, n - 1] = k[b], v[b]
        keys, values = kb[b, :, :n], vb[b, :, :n]
        scores = torch.matmul(q[b].view(Hkv, H // Hkv, D), keys.transpose(-1, -2)) * scale
        out.append(torch.matmul(torch.softmax(scores, dim=-1), values).reshape(H * D))
    return torch.stack(out)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 24), (2, 1, 12)])
@pytest.mark.parametrize("rot", [None, "full", "half"])
def test_attend_equals_the_reference(H, Hkv, D, rot):
    g = torch.Generator().manual_seed(H * D)
    lens = torch.tensor([1, 127, 128, 129, 300], dtype=torch.long)  # across the kernel's 128-column blocks
    B, cols = len(lens), 320
    q, k, v = torch.randn(B, H, D, generator=g), torch.randn(B, Hkv, D, generator=g), torch.randn(B, Hkv, D, generator=g)
    kb, vb = torch.randn(B, Hkv, cols, D, generator=g), torch.randn(B, Hkv, cols, D, generator=g)
    cos = sin = None
    if rot is not None:
        width = D if rot == "full" else D // 2
        angle = torch.rand(B, width // 2, generator=g) * 6.3
        cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    kb_ref, vb_ref, q_before = kb.clone(), vb.clone(), q.clone()
    want = attend_reference(q, k, v, kb_ref, vb_ref, lens, D ** -0.5, cos, sin)
    got = NATIVE.attend(q, k, v, kb, vb, lens, D ** -0.5, cos, sin)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kb, kb_ref, atol=1e-6, rtol=1e-6)  # the new (rotated) key written in place
    assert torch.equal(vb, vb_ref) and torch.equal(q, q_before)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_equals_the_torch_update(rows, groups):
    """Between in_proj and out_proj: the conv shift, the state update and the gated group norm, `NativeOps.mamba2`
    against `TorchOps.mamba2` (the mixer's torch code) from the same conv and state rows, over several tokens."""
    model = tiny_model("bamba", mamba_n_groups=groups)
    layer = next(layer.mamba for layer in model.model.layers if getattr(layer, "mamba", None) is not None)
    mixer = Mamba2(layer, 0, TorchOps())
    g = torch.Generator().manual_seed(rows)
    conv_t = torch.randn(rows, mixer.C, mixer.conv_w.shape[-1], generator=g)
    state_t = torch.randn(rows, mixer.H, mixer.P, mixer.N, generator=g)
    conv_n, state_n = conv_t.clone(), state_t.clone()
    with torch.inference_mode():
        for _ in range(4):
            zx = torch.randn(rows, mixer.I + mixer.C + mixer.H, generator=g)
            want = TorchOps().mamba2(mixer, zx, conv_t, state_t)
            got = NativeOps(NATIVE).mamba2(mixer, zx, conv_n, state_n)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(conv_n, conv_t, atol=0, rtol=0)
            torch.testing.assert_close(state_n, state_t, atol=1e-5, rtol=1e-4)


def fake_batch(lengths):
    return SimpleNamespace(lengths=list(lengths), model=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32))


@pytest.mark.parametrize("counts", [(1, 1, 1), (3, 1, 2)], ids=["one token a row", "several tokens a row"])
@pytest.mark.parametrize("rotary", [False, True])
def test_native_attend_equals_torch_ops(counts, rotary):
    """The attention op as the step and the verification call it (`Rows` of one or several tokens a row, rows
    of different lengths): `NativeOps.attend` against `TorchOps.attend`, outputs and the K/V written."""
    g = torch.Generator().manual_seed(sum(counts))
    H, Hkv, D, cols = 6, 2, 32, 300
    lengths = [129, 4, 200]
    N = sum(counts)
    q, k, v = torch.randn(N, H, D, generator=g), torch.randn(N, Hkv, D, generator=g), torch.randn(N, Hkv, D, generator=g)
    kb, vb = torch.randn(3, Hkv, cols, D, generator=g), torch.randn(3, Hkv, cols, D, generator=g)
    cos = sin = None
    if rotary:
        angle = torch.rand(N, D // 4, generator=g) * 6.3  # partial rotary: half the head
        cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    out = {}
    for name, ops in (("torch", TorchOps()), ("native", NativeOps(NATIVE))):
        kv = KVRows(kb.clone(), vb.clone())
        rows = ops.prepare(Rows(fake_batch(lengths), counts, cos, sin))
        out[name] = (ops.attend(q.clone(), k.clone(), v.clone(), kv, rows, D ** -0.5), kv)
    torch.testing.assert_close(out["native"][0], out["torch"][0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out["native"][1].keys, out["torch"][1].keys, atol=1e-6, rtol=1e-6)
    assert torch.equal(out["native"][1].values, out["torch"][1].values)


@pytest.mark.parametrize("weights,bound", [(torch.float32, 1e-5), (torch.float16, 2e-2), (torch.int8, 0.1)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_equals_torch_ops(weights, bound, bias):
    """The same linears fused by each table (TorchOps [in, out], NativeOps [out, in] or its fp16 / int8 copy): the
    products agree (fp32 exactly up to summation order; the copies within their precision), 1 to 17 rows."""
    g = torch.Generator().manual_seed(3)
    lins = [torch.nn.Linear(40, n, bias=bias) for n in (24, 9)]
    for lin in lins:
        lin.weight.data = torch.randn(lin.weight.shape, generator=g) / 40 ** 0.5
    native = NativeOps(NATIVE, weights)
    w_n = native.linear_weight(lins)
    w_t = TorchOps().linear_weight(lins)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(native.linear(x, w_n), TorchOps().linear(x, w_t), atol=bound, rtol=bound)


def test_native_add_norm_and_gate_equal_torch_ops():
    """The residual add + norm (plain and zero-centred norms) and silu(gate) * up on both tables."""
    g = torch.Generator().manual_seed(5)
    h, d = torch.randn(3, 48, generator=g), torch.randn(3, 48, generator=g)
    plain = torch.nn.RMSNorm(48, eps=1e-6)
    plain.weight.data = torch.randn(48, generator=g)
    model = tiny_model("qwen3_5")  # its norms are zero-centred: (1 + w)
    for norm in (Norm(plain), Norm(model.model.layers[0].input_layernorm)):
        h_t, h_n = h.clone(), h.clone()
        if norm.weight.shape[0] != 48:
            h_t, h_n, d = (torch.randn(3, norm.weight.shape[0], generator=g) for _ in range(3))
            h_n = h_t.clone()
        want = TorchOps().add_rmsnorm(h_t, d, norm)
        got = NativeOps(NATIVE).add_rmsnorm(h_n, d, norm)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(h_n, h_t, atol=0, rtol=0)
    gu = torch.randn(2, 64, generator=g) * 4
    torch.testing.assert_close(NativeOps(NATIVE).silu_mul(gu), TorchOps().silu_mul(gu), atol=1e-6, rtol=1e-5)


def test_attend_several_tokens_of_a_row_attend_causally():
    """Speculation's verification forward: the tokens of a row (`rows` maps each query to its buffer row) are
    written at consecutive columns, and each attends to its row's columns up to its own."""
    g = torch.Generator().manual_seed(7)
    H, Hkv, D, cols = 6, 2, 64, 400
    rows = torch.tensor([0, 0, 0, 1, 2, 2], dtype=torch.long)  # 3 tokens of row 0, 1 of row 1, 2 of row 2
    lens = torch.tensor([130, 131, 132, 5, 299, 300], dtype=torch.long)
    N = len(rows)
    q, k, v = torch.randn(N, H, D, generator=g), torch.randn(N, Hkv, D, generator=g), torch.randn(N, Hkv, D, generator=g)
    kb, vb = torch.randn(3, Hkv, cols, D, generator=g), torch.randn(3, Hkv, cols, D, generator=g)
    angle = torch.rand(N, D // 2, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    kb_ref, vb_ref = kb.clone(), vb.clone()
    qr, kr = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
    for i in range(N):  # every new column first, then each token over its row's columns up to its own
        kb_ref[rows[i], :, lens[i] - 1], vb_ref[rows[i], :, lens[i] - 1] = kr[i], v[i]
    want = torch.stack([
        torch.matmul(torch.softmax(torch.matmul(qr[i].view(Hkv, H // Hkv, D), kb_ref[rows[i], :, :lens[i]].transpose(-1, -2))
                                   * D ** -0.5, dim=-1), vb_ref[rows[i], :, :lens[i]]).reshape(H * D) for i in range(N)])
    got = NATIVE.attend(q, k, v, kb, vb, lens, D ** -0.5, cos, sin, rows=rows)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kb, kb_ref, atol=1e-6, rtol=1e-6)


def test_attend_refuses_lengths_or_rows_outside_the_buffers():
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    kb, vb = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    for lens, rows in ((torch.tensor([3, 9]), None), (torch.tensor([0, 2]), None),
                       (torch.tensor([3, 4]), torch.tensor([0, 2]))):
        with pytest.raises(ValueError, match="lengths 1..8 and rows 0..1"):
            NATIVE.attend(q, k, v, kb, vb, lens, 0.25, rows=rows)
    assert torch.equal(kb, torch.zeros_like(kb))  # nothing was written


# --- the blocks: a layer's part as one native call (native/blocks.cpp), against the same ops called one by one ---
BLOCK_WEIGHTS = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def composed(ops: NativeOps):
    """`ops`' blocks as the base table composes them (its own native ops, one call each)."""
    return SimpleNamespace(**{name: (lambda *a, _f=getattr(TorchOps, name): _f(ops, *a))
                              for name in ("mlp_block", "norm_linear", "mamba2_block", "attention_block")})


def stream(rows: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)


@pytest.mark.parametrize("weights", BLOCK_WEIGHTS)
@pytest.mark.parametrize("rows", [1, 3])
def test_mlp_and_head_blocks_equal_their_ops_bit_for_bit(weights, rows):
    """h += d, the norm, gate_up, silu * up, down (and the final norm + lm_head): one call each, the same numbers
    as the ops one by one, h advanced alike; and within fp32 rounding of TorchOps' on fp32 weights."""
    from hypic_core.runner.decode_step import MLP

    model = tiny_model("llama")
    layer = model.model.layers[0]
    ops = NativeOps(NATIVE, weights)
    mlp, norm = MLP(layer.mlp, ops), Norm(layer.post_attention_layernorm)
    head = ops.linear_weight([model.lm_head])
    h, d = stream(rows, norm.weight.shape[0], rows)
    for res in (d, None):
        h_b, h_c = h.clone(), h.clone()
        assert torch.equal(ops.mlp_block(h_b, res, norm, mlp), composed(ops).mlp_block(h_c, res, norm, mlp))
        assert torch.equal(h_b, h_c)
        assert torch.equal(ops.norm_linear(h_b, res, norm, head), composed(ops).norm_linear(h_c, res, norm, head))
        assert torch.equal(h_b, h_c)
    if weights == torch.float32:
        ref = tiny_model("llama").model.layers[0]
        mlp_t = MLP(ref.mlp, TorchOps())
        h_t = h.clone()
        torch.testing.assert_close(ops.mlp_block(h.clone(), d, norm, mlp), TorchOps().mlp_block(h_t, d, norm, mlp_t),
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("weights", BLOCK_WEIGHTS)
@pytest.mark.parametrize("rows", [1, 3])
def test_mamba2_block_equals_its_ops_bit_for_bit(weights, rows):
    """h += d, the norm, in_proj, the Mamba2 update (conv and state rows advanced), out_proj: one call, the same
    numbers, conv and state as the ops one by one leave them, over several tokens."""
    model = tiny_model("bamba")
    i, layer = next((i, layer) for i, layer in enumerate(model.model.layers) if getattr(layer, "mamba", None) is not None)
    ops = NativeOps(NATIVE, weights)
    mixer, norm = Mamba2(layer.mamba, 0, ops), Norm(layer.input_layernorm)
    g = torch.Generator().manual_seed(rows)
    conv_b = torch.randn(rows, mixer.C, mixer.conv_w.shape[-1], generator=g)
    state_b = torch.randn(rows, mixer.H, mixer.P, mixer.N, generator=g)
    conv_c, state_c = conv_b.clone(), state_b.clone()
    h_b, _ = stream(rows, norm.weight.shape[0], 7)
    h_c = h_b.clone()
    for t in range(3):
        d = None if t == 0 else torch.randn(rows, norm.weight.shape[0], generator=g)
        got = ops.mamba2_block(h_b, d, norm, mixer, conv_b, state_b)
        want = composed(ops).mamba2_block(h_c, d, norm, mixer, conv_c, state_c)
        assert torch.equal(got, want) and torch.equal(h_b, h_c)
        assert torch.equal(conv_b, conv_c) and torch.equal(state_b, state_c)


@pytest.mark.parametrize("weights", BLOCK_WEIGHTS)
@pytest.mark.parametrize("counts", [(1, 1, 1), (3, 1, 2)], ids=["one token a row", "several tokens a row"])
def test_attention_block_equals_its_ops_bit_for_bit(weights, counts):
    """h += d, the norm, q | k | v, rotary, the K/V write, attention, o: one call, the same numbers and the same
    K/V written as the ops one by one; several tokens a row (a verification) included."""
    from hypic_core.runner.decode_step import Attention

    model = tiny_model("llama")
    layer = model.model.layers[0]
    ops = NativeOps(NATIVE, weights)
    attn, norm = Attention(layer.self_attn, 0, model.config, ops), Norm(layer.input_layernorm)
    assert attn.plain
    g = torch.Generator().manual_seed(len(counts))
    lengths, cols = [9, 2, 30], 40
    kb = torch.randn(3, attn.Hkv, cols, attn.D, generator=g)
    vb = torch.randn(3, attn.Hkv, cols, attn.D, generator=g)
    N = sum(counts)
    pos = torch.tensor([n + t for n, c in zip(lengths, counts) for t in range(c)])
    cos, sin = (t[0] for t in model.model.rotary_emb(torch.zeros(1, N, 1), pos[None]))
    h, d = stream(N, norm.weight.shape[0], 11)
    out = {}
    for name, table in (("block", ops), ("ops", composed(ops))):
        kv = KVRows(kb.clone(), vb.clone())
        batch = SimpleNamespace(lengths=lengths, model=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32),
                                attention_layer=lambda j, kv=kv: kv)
        rows = ops.prepare(Rows(batch, counts, cos.contiguous(), sin.contiguous()))
        h_r = h.clone()
        out[name] = (table.attention_block(h_r, d, norm, attn, rows), h_r, kv)
    assert torch.equal(out["block"][0], out["ops"][0]) and torch.equal(out["block"][1], out["ops"][1])
    assert torch.equal(out["block"][2].keys, out["ops"][2].keys) and torch.equal(out["block"][2].values, out["ops"][2].values)


def test_attention_block_refuses_lengths_outside_the_buffers_and_writes_nothing():
    from hypic_core.runner.decode_step import Attention

    model = tiny_model("llama")
    ops = NativeOps(NATIVE)
    attn, norm = Attention(model.model.layers[0].self_attn, 0, model.config, ops), Norm(model.model.layers[0].input_layernorm)
    kb, vb = torch.zeros(2, attn.Hkv, 8, attn.D), torch.zeros(2, attn.Hkv, 8, attn.D)
    h, d = stream(2, norm.weight.shape[0], 3)
    h0 = h.clone()
    with pytest.raises(ValueError, match="lengths 1..8 and rows 0..1"):
        NATIVE.attention_block(h, d, norm.native_weight, norm.eps, attn.qkv, attn.o, kb, vb, torch.tensor([3, 9]),
                               attn.scale, attn.H, attn.Hkv, attn.D)
    assert torch.equal(h, h0) and not kb.any() and not vb.any()
