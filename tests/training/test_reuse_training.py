"""Reuse-aware training (training/reuse) on tiny random models: the composed forward is the engine's
(equal to full at a seam covering every segment), training lowers the loss, a resumed run is the
uninterrupted one, and the merged export is the adapter-applied model."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import random_segments
from hypic_core.testing import tiny_model
from training.reuse import lora
from training.reuse.data import Layout, Sample, counts, mixed
from training.reuse.modes import Composer, full_logits
from training.reuse.trainer import TrainConfig, Trainer, kl, run

FAMILIES = ["bamba", "qwen3_5", "llama"]  # Mamba2, Gated DeltaNet, dense


def sample(seed: int = 0, lengths=(6, 20, 17, 23, 9), reply: int = 6) -> Sample:
    """A leading segment, three documents, a question; then a reply (token ids of a tiny vocabulary)."""
    segs = random_segments(lengths + (reply,), seed=seed)
    return Sample(Layout(segs[:-1], exact_prefix=1), segs[-1], "test")


def samples_from(cursor: int):
    return ((i, sample(seed=i % 3)) for i in range(cursor, 10**6))


def assert_close(name, ref, out, atol):
    err = (ref - out).abs().max().item()
    assert err <= atol, f"{name}: max abs error {err:.3g} > {atol}"


@pytest.mark.parametrize("family", FAMILIES)
def test_composed_equals_full_when_the_seam_covers_every_segment(family):
    model = tiny_model(family)
    s = sample()
    lora.attach(model, rank=4)
    with torch.no_grad():  # a non-zero adapter: the composed path runs through the LoRA modules too
        for p in lora.parameters(model):
            p.normal_(0, 0.05)
    full = full_logits(model, s.layout, s.reply)
    composed = Composer(model, seam=64).logits(s.layout, s.reply)
    assert_close(f"{family} seam 64", full, composed, 2e-4)
    assert kl(full, composed).item() < 1e-6
    seam0 = Composer(model, seam=0).logits(s.layout, s.reply)
    assert kl(full, seam0).item() > 1e-4, "composing with no seam changed nothing: the test would not see a wrong stitch"


@pytest.mark.parametrize("family", FAMILIES)
def test_training_lowers_the_loss(family, tmp_path):
    model = tiny_model(family)
    trainer = Trainer(TrainConfig(model=family, out=str(tmp_path), rank=4, seam=0, lr=1e-3, warmup=1), model)
    s = sample()
    before = trainer.evaluate(s)
    assert before[0] < 1e-9, "the base model is its own teacher: full starts at KL 0"
    assert before[1] > 1e-4
    for _ in range(15):
        trainer.train_step(s)
    after = trainer.evaluate(s)
    assert sum(after) < 0.6 * sum(before), (before, after)


def test_the_consistency_term_closes_the_gap_between_composed_and_full_that_the_teacher_terms_leave():
    """With a teacher the student cannot match (another random model), the teacher terms alone leave
    composed and full with different residuals; KL(full || composed) as a third term is what lowers
    that gap, the quantity the faithfulness measure counts."""
    s = sample()

    def gap_after(consistency: float) -> float:
        torch.manual_seed(0)
        teacher = tiny_model("bamba", seed=1)
        trainer = Trainer(TrainConfig(model="bamba", out="-", rank=4, seam=0, lr=1e-2, warmup=1,
                                      consistency=consistency), tiny_model("bamba"), teacher)
        before = trainer.evaluate(s)
        for _ in range(12):
            step = trainer.train_step(s)
        assert step.gap >= 0 and step.loss == pytest.approx(step.kl_full + step.kl_composed + consistency * step.gap, rel=1e-5)
        return before[2], trainer.evaluate(s)[2]

    base_before, plain = gap_after(0.0)
    _, tuned = gap_after(32.0)
    assert base_before > 1e-4
    assert tuned < 0.5 * plain, (base_before, plain, tuned)


def test_the_student_reply_is_its_own_greedy_full_answer():
    model = tiny_model("bamba")
    teacher = tiny_model("bamba", seed=1)
    s = sample()
    trainer = Trainer(TrainConfig(model="bamba", out="-", rank=4, seam=2, reply="student", reply_tokens=5), model, teacher)
    reply = trainer.reply_for(s)
    ids = list(s.layout.ids)
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert list(reply) == ids[len(s.layout.ids):], "not the student's greedy continuation (adapters on, full mode)"
    teacher_reply = Trainer(TrainConfig(model="bamba", out="-", rank=4, seam=2, reply_tokens=5), tiny_model("bamba"),
                            teacher).reply_for(Sample(s.layout, None, "test"))
    assert teacher_reply != reply, "the two replies coincide: the test would not tell them apart"
    with pytest.raises(ValueError, match="reply"):
        TrainConfig(model="bamba", out="-", reply="teacher")


def test_a_resumed_run_continues_the_uninterrupted_one(tmp_path):
    def trainer(out, steps):
        return Trainer(TrainConfig(model="bamba", out=str(out), rank=4, seam=2, lr=3e-3, warmup=2, steps=steps,
                                   minutes=10, save_minutes=1000), tiny_model("bamba"))

    whole = run(trainer(tmp_path / "a", 4), samples_from, tmp_path / "a", progress=lambda m: None)
    first = run(trainer(tmp_path / "b", 2), samples_from, tmp_path / "b", progress=lambda m: None)
    assert first.step == 2 and first.cursor == 2
    seen = []
    resumed = run(trainer(tmp_path / "b", 4), samples_from, tmp_path / "b", progress=seen.append)
    assert any("resuming" in m and "step 2" in m for m in seen)
    assert resumed.step == 4 and resumed.cursor == 4
    a, b = lora.factors(whole.student), lora.factors(resumed.student)
    for k in a:
        assert_close(k, a[k], b[k], 1e-6)
    lines = (tmp_path / "b" / "log.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_a_run_continues_an_exported_adapter_on_another_machine(tmp_path):
    """No checkpoint at hand (a new machine), only the shipped adapter: the run starts from its factors,
    step and data cursor, and refuses an adapter of another rank."""
    from training.reuse.trainer import export_adapter

    def trainer(out, steps, rank=4):
        return Trainer(TrainConfig(model="bamba", out=str(out), rank=rank, seam=2, lr=3e-3, warmup=2, steps=steps,
                                   minutes=10, save_minutes=1000), tiny_model("bamba"))

    first = run(trainer(tmp_path / "a", 2), samples_from, tmp_path / "a", progress=lambda m: None)
    shipped = export_adapter(first, tmp_path / "shipped")
    assert json.loads((shipped / "adapter.json").read_text())["cursor"] == 2
    seen = []
    fresh = trainer(tmp_path / "b", 2)  # steps=2: nothing left to train, the warm start alone
    run(fresh, samples_from, tmp_path / "b", progress=seen.append, init=shipped)
    assert any("continuing" in m and "step 2" in m for m in seen)
    assert fresh.step == 2 and fresh.cursor == 2
    a, b = lora.factors(first.student), lora.factors(fresh.student)
    for k in a:  # shipped in bf16
        assert_close(k, a[k].to(torch.bfloat16).float(), b[k], 1e-6)
    more = run(trainer(tmp_path / "c", 3), samples_from, tmp_path / "c", progress=lambda m: None, init=shipped)
    assert more.step == 3 and more.cursor == 3
    with pytest.raises(ValueError, match="rank"):
        run(trainer(tmp_path / "d", 3, rank=8), samples_from, tmp_path / "d", progress=lambda m: None, init=shipped)
    # a checkpoint in --out wins over the adapter
    seen.clear()
    run(trainer(tmp_path / "a", 2), samples_from, tmp_path / "a", progress=seen.append, init=shipped)
    assert any("resuming" in m for m in seen)


def test_resume_refuses_a_checkpoint_of_another_rank(tmp_path):
    cfg = TrainConfig(model="bamba", out=str(tmp_path), rank=4, seam=2, steps=1, save_minutes=1000)
    run(Trainer(cfg, tiny_model("bamba")), samples_from, tmp_path, progress=lambda m: None)
    other = Trainer(TrainConfig(model="bamba", out=str(tmp_path), rank=8, seam=2, steps=2), tiny_model("bamba"))
    with pytest.raises(ValueError, match="rank"):
        run(other, samples_from, tmp_path, progress=lambda m: None)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_merged_export_is_the_adapter_applied_model(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from hypic_core.models.registry import resolve, served_name
    from training.reuse.trainer import export_adapter

    base = tiny_model(family)
    base.save_pretrained(tmp_path / "base")
    trainer = Trainer(TrainConfig(model=family, out=str(tmp_path), rank=4, seam=2, lr=1e-2, warmup=1), copy.deepcopy(base))
    for i in range(3):
        trainer.train_step(sample(i))
    export_adapter(trainer, tmp_path / "adapter")
    from safetensors.torch import load_file

    lora.load_factors(trainer.student, {k: v.float() for k, v in load_file(tmp_path / "adapter" / "adapter.safetensors").items()})
    spec = f"{tmp_path / 'base'}+{tmp_path / 'adapter'}"  # what `hypic serve --model` takes
    resolved = resolve(spec, cache_dir=tmp_path / "cache")
    assert resolved.source == "adapted" and served_name(spec) == "base+adapter"
    assert resolve(spec, cache_dir=tmp_path / "cache").path == resolved.path  # merged once, then found
    merged = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    ids = torch.tensor([sample(5).layout.ids])
    trainer.student.eval()
    with torch.no_grad():
        ref = trainer.student(input_ids=ids).logits
        out = merged(input_ids=ids).logits
        untrained = base(input_ids=ids).logits
    assert_close(f"{family} merged", ref, out, 1e-4)
    assert (ref - untrained).abs().max().item() > 1e-3, "the adapter changed nothing: the comparison would not see a bad merge"
    in_memory = copy.deepcopy(trainer.student)
    lora.detach(in_memory)
    assert not lora.modules(in_memory)
    with torch.no_grad():
        assert_close(f"{family} detached", ref, in_memory(input_ids=ids).logits, 1e-4)


def test_mixed_sources_resume_where_they_left_off():
    def source(tag, start):
        i = start
        while True:
            yield f"{tag}{i}"
            i += 1

    weights, seed = (0.7, 0.3), 1
    whole = [s for _, s in zip(range(20), mixed([source("a", 0), source("b", 0)], weights, seed))]
    n = counts(8, weights, seed)
    resumed = [s for _, s in zip(range(12), mixed([source("a", n[0]), source("b", n[1])], weights, seed, 8))]
    assert [s for _, s in whole[8:]] == [s for _, s in resumed]
    assert {s[0] for _, s in whole} == {"a", "b"}


def test_an_adapter_spec_names_what_is_missing(tmp_path):
    from hypic_core.models.registry import ModelNotFoundError, resolve

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve(f"hypic-tiny+{tmp_path / 'nowhere'}", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="not a reuse adapter"):
        resolve(f"hypic-tiny+{tmp_path / 'empty'}", cache_dir=tmp_path)


def test_the_reuse_models_are_named_over_their_bases():
    from hypic_core.models.registry import KNOWN_MODELS, REUSE_BASES

    for name, base in REUSE_BASES.items():
        assert name in KNOWN_MODELS and base in KNOWN_MODELS
        assert KNOWN_MODELS[name].prompt == KNOWN_MODELS[base].prompt  # served with the layout it was trained on


def test_a_reuse_model_without_its_adapter_says_to_train_one_not_to_install(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from app.cli import cli
    from hypic_core.models import registry

    monkeypatch.setattr(registry, "REPO_ROOT", tmp_path)  # no models/<name>/ adapters here
    (tmp_path / "models" / "smollm2-hybrid-135m-reuse").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-hybrid-135m-reuse" / "adapter.json").write_text("{}")  # a card without its factors
    for name, base in registry.REUSE_BASES.items():
        known = registry.KNOWN_MODELS[name]
        assert not known.available()
        hint = known.how_to_get()
        assert f"models/{name}/adapter.safetensors" in hint and f"hypic tune --model {base}" in hint, hint
        with pytest.raises(registry.ModelNotFoundError, match="reuse adapter is not shipped"):
            registry.resolve(name, cache_dir=tmp_path / "cache")
    listing = CliRunner().invoke(cli, ["models"], env={"COLUMNS": "400"})
    assert listing.exit_code == 0 and "not shipped yet" in listing.output and "no: install it with: hypic models install smollm2-135m-instruct-reuse" not in listing.output
    # a model that installing does give keeps its install command
    assert registry.KNOWN_MODELS["hypic-tiny"].how_to_get().startswith("install it with: ")


def test_hypic_tune_trains_on_the_ingested_documents_resumes_and_its_adapter_loads(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from app.cli import cli
    from hypic_core.models.loader import load_local
    from hypic_core.models.registry import resolve
    from training.reuse.ship import read_log

    monkeypatch.setenv("HYPIC_MODELS_DIR", str(tmp_path / "models"))
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, (city, river) in enumerate([("Seinaim", "Peiryas"), ("Gripaith", "Nukreix"), ("Jasteirk", "Oulmar"), ("Tavrel", "Ismor")]):
        (docs / f"d{i}.txt").write_text(f"{city} is a city on the river {river}. It was founded long ago by traders.\n\n"
                                        f"The people of {city} fish in the {river} and sell what they catch.\n")
    runner = CliRunner()
    # the default embedder, as a user's index has it: its manifest records "all-MiniLM-L6-v2", which
    # tune reopens the index with (it once refused that name)
    ingest = runner.invoke(cli, ["ingest", str(docs), "--index-dir", str(tmp_path / "index"), "--model", "hypic-tiny"])
    assert ingest.exit_code == 0, ingest.output
    out = tmp_path / "run"
    args = ["tune", "--model", "hypic-tiny", "--out", str(out), "--index-dir", str(tmp_path / "index"), "--rank", "4",
            "--lr", "1e-2", "--save-minutes", "1000"]
    first = runner.invoke(cli, args + ["--steps", "2"])
    assert first.exit_code == 0, first.output
    assert [r["step"] for r in read_log(out / "log.jsonl")] == [1, 2]
    again = runner.invoke(cli, args + ["--steps", "3"])
    assert again.exit_code == 0, again.output
    assert [r["step"] for r in read_log(out / "log.jsonl")] == [1, 2, 3]

    measured = runner.invoke(cli, args + ["--evaluate", "2"])
    assert measured.exit_code == 0, measured.output
    result = json.loads((out / "evaluation.json").read_text())
    assert result["step"] == 3 and result["samples"] == 2
    assert result["base"]["kl_full"] < 1e-9  # its own base is the teacher
    assert result["tuned"]["kl_full"] > 0 and result["tuned"]["kl_composed"] != result["base"]["kl_composed"]

    base, _ = load_local(resolve("hypic-tiny").path)
    tuned, _ = load_local(resolve(f"hypic-tiny+{out / 'adapter'}").path)
    ids = torch.tensor([[5, 17, 42, 99, 7, 8, 120]])
    with torch.no_grad():
        assert (base(input_ids=ids).logits - tuned(input_ids=ids).logits).abs().max().item() > 1e-4


def test_hypic_tune_names_an_index_that_is_not_one(tmp_path):
    from typer.testing import CliRunner

    from app.cli import cli

    res = CliRunner().invoke(cli, ["tune", "--model", "hypic-tiny", "--out", str(tmp_path / "run"), "--index-dir", str(tmp_path)])
    assert res.exit_code == 2
    assert "not an index" in " ".join(res.output.replace("│", " ").split())  # the message, unwrapped from its box


def test_shipping_a_continued_run_keeps_the_curve_of_the_steps_logged_elsewhere(tmp_path):
    """A run continued from the shipped adapter (`hypic tune --init`) logs only its own steps: the model card's
    curve keeps the blocks the model directory held for the steps before them."""
    from training.reuse.ship import CURVE_FILE, ship

    run, target = tmp_path / "run", tmp_path / "model"
    (run / "adapter").mkdir(parents=True)
    from safetensors.torch import save_file

    save_file({f"model.layers.{i}.{m}.{p}.lora_{s}": torch.zeros(2, 2) for i, m, p in
               ((0, "self_attn", "v_proj"), (0, "self_attn", "q_proj"), (1, "mamba", "out_proj"), (1, "mamba", "in_proj"))
               for s in ("down", "up")}, str(run / "adapter" / "adapter.safetensors"))
    card = {"base": "b", "teacher": "t", "rank": 4, "seam": 8, "step": 8, "cursor": 8, "train_seconds": 7200.0,
            "lr": 3e-4, "precision": "fp32", "consistency": 10.0, "reply": "student", "data": "distill"}
    (run / "adapter" / "adapter.json").write_text(json.dumps(card))
    (run / "log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1 * s, "kl_full": 0.01 * s, "kl_composed": 0.02 * s,
                                                       "gap": 0.001 * s, "seconds": 10.0}) + "\n" for s in (5, 6, 7, 8)))
    target.mkdir()
    (target / "README.md").write_text(
        "# old card\n\n| steps | loss | KL full | KL composed | composed - full | gap KL(full \\|\\| composed) | s/step |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n| 1-2 | 0.5000 | 0.2000 | 0.3000 | +0.1000 |  | 80 |\n"
        "| 3-4 | 0.4000 | 0.1500 | 0.2000 | +0.0500 | 0.0100 | 40 |\n| 5-6 | 0.9 | 0.9 | 0.9 | +0.0 | 0.9 | 9 |\n")
    ship(run, target, "model")
    text = (target / "README.md").read_text()
    steps = [ln.split("|")[1].strip() for ln in text.splitlines() if ln.startswith("| ") and ln.split("|")[1].strip()[:1].isdigit()]
    assert steps == ["1-2", "3-4", "5-5", "6-6", "7-7", "8-8"]  # the old 5-6 block gives way to the run's own steps
    assert "LoRA (rank 4) on every attention layer's q, v projections and every Mamba2 mixer's in, out projections" in text
    assert "hypic tune --model b --teacher t --data distill" in text and "--out var/run " in text
    assert "| 1-2 | 0.5000 | 0.2000 | 0.3000 | +0.1000 |  | 80 |" in text and "| 3-4 | 0.4000 | 0.1500 | 0.2000 | +0.0500 | 0.0100 | 40 |" in text
    saved = json.loads((target / CURVE_FILE).read_text())
    assert [r["steps"] for r in saved] == steps and saved[0]["gap"] is None
    ship(run, target, "model")  # again: from curve.json, the same card
    assert (target / "README.md").read_text() == text


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_full_fine_tuning_lowers_the_loss_and_its_export_merges_into_the_checkpoint(family, tmp_path):
    """Ladder rung (b): every decoder-layer parameter trained; the base (original weights) is the
    teacher; the exported deltas, merged by the loader, give the trained model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hypic_core.models.registry import resolve
    from training.reuse.trainer import export_adapter

    base = tiny_model(family)
    base.save_pretrained(tmp_path / "base")
    trainer = Trainer(TrainConfig(model=family, out=str(tmp_path), method="full", seam=0, lr=1e-4, warmup=1),
                      copy.deepcopy(base))
    assert not lora.modules(trainer.student), "full fine-tuning attaches no adapter"
    trained = {id(p) for p in trainer.params}
    assert all((id(p) in trained) == n.startswith("model.layers.") for n, p in trainer.student.named_parameters())
    s = sample()
    before = trainer.evaluate(s)
    assert before[0] < 1e-9 and before[1] > 1e-4
    for _ in range(10):
        trainer.train_step(s)
    after = trainer.evaluate(s)
    # composed moves to the teacher; full, which starts on it, stays nearer than composed began
    assert after[1] < 0.6 * before[1] and after[0] < before[1], (before, after)
    with trainer.tuning.disabled():  # the original weights inside, the tuned ones back after
        assert trainer.evaluate(s)[0] < 1e-9
    assert trainer.evaluate(s) == after

    export_adapter(trainer, tmp_path / "adapter")
    deltas = load_file(tmp_path / "adapter" / "adapter.safetensors")
    assert deltas and all(k.endswith(".delta") for k in deltas)
    assert json.loads((tmp_path / "adapter" / "adapter.json").read_text())["method"] == "full"
    trainer.tuning.load_state({k: v.float() for k, v in deltas.items()})  # the bf16 deltas the file holds
    merged = AutoModelForCausalLM.from_pretrained(resolve(f"{tmp_path / 'base'}+{tmp_path / 'adapter'}",
                                                          cache_dir=tmp_path / "cache").path, dtype=torch.float32).eval()
    ids = torch.tensor([sample(5).layout.ids])
    trainer.student.eval()
    with torch.no_grad():
        ref, out, untrained = trainer.student(input_ids=ids).logits, merged(input_ids=ids).logits, base(input_ids=ids).logits
    assert_close(f"{family} merged deltas", ref, out, 1e-4)
    assert (ref - untrained).abs().max().item() > 1e-3
    other = Trainer(TrainConfig(model=family, out=str(tmp_path / "b"), method="full", seam=0, lr=1e-4, warmup=1),
                    copy.deepcopy(base))
    other.warm_start(tmp_path / "adapter")  # `hypic tune --init`: the exported deltas, step and cursor
    assert other.step == trainer.step and all(torch.equal(p, q) for p, q in zip(other.params, trainer.params))


def test_resume_refuses_a_checkpoint_of_another_method(tmp_path):
    cfg = TrainConfig(model="bamba", out=str(tmp_path), rank=4, seam=2, steps=1, save_minutes=1000)
    run(Trainer(cfg, tiny_model("bamba")), samples_from, tmp_path, progress=lambda m: None)
    other = Trainer(TrainConfig(model="bamba", out=str(tmp_path), method="full", rank=4, seam=2, steps=2), tiny_model("bamba"))
    with pytest.raises(ValueError, match="method"):
        run(other, samples_from, tmp_path, progress=lambda m: None)


def test_a_users_chunks_are_cut_into_pieces_that_several_fit_a_prompt():
    """`hypic tune --data index` trains on pieces of the ingested chunks: runs of sentences within the
    bounds, a sentence longer than the upper bound cut into windows, every word kept but a short tail
    (a chunk too short for any piece is kept whole)."""
    from training.reuse.data import pieces

    text = "One two three. Four five six seven.\n\nEight nine ten eleven twelve. " + " ".join(f"w{i}" for i in range(10))
    out = pieces([text], lo=2, hi=6)
    assert out == ["One two three.", "Four five six seven.", "Eight nine ten eleven twelve.", "w0 w1 w2 w3 w4 w5", "w6 w7 w8 w9"]
    assert pieces(["a b. c d.\n\ne f."], lo=1, hi=6) == ["a b. c d.\n\ne f."]  # a paragraph break inside a piece stays
    assert pieces(["tiny.", " "], lo=2, hi=6) == ["tiny."]  # too short for a piece: kept whole
    chunk = " ".join(f"Sentence number {i} says a few more words." for i in range(60))  # ~480 words, one paragraph
    cut = pieces([chunk])
    assert len(cut) >= 5 and all(30 <= len(p.split()) <= 90 for p in cut)
