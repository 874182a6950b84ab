"""Link tokens, the reuse ladder's third rung (training/reuse/links.py, `hypic tune --link`): only
their embedding rows train (beside LoRA), the teacher reads the prompt without them, the export
merged by the loader is the trained model and serves with the link; the prompter writes the link
after every document; a link is special tokens without a role."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import random_segments
from hypic_core.testing import tiny_model
from training.reuse.data import Layout, Sample
from training.reuse.links import LinkRows, link_ids, unused_specials
from training.reuse.modes import Composer, full_logits
from training.reuse.trainer import TrainConfig, Trainer, export_adapter, kl

LINK = (3, 4)  # two ids of the tiny vocabulary


def linked(seed: int = 0, lengths=(6, 20, 17, 23), question: int = 9, reply: int = 6) -> Sample:
    """A leading segment, three documents each followed by the link, a question; then a reply."""
    segs = random_segments(lengths + (question, reply), seed=seed)
    head, docs, q, r = segs[0], segs[1:-2], segs[-2], segs[-1]
    body = tuple(s for d in docs for s in (d, LINK))
    return Sample(Layout((head, *body, q), exact_prefix=1), r, "test")


def test_a_layout_without_its_link_is_the_prompt_a_model_without_links_reads():
    s = linked()
    plain = s.layout.without(LINK)
    assert len(plain.segments) == len(s.layout.segments) - 3 and LINK not in plain.segments
    assert plain.ids == [t for i, seg in enumerate(s.layout.segments) if seg != LINK for t in seg]
    assert s.layout.without(()) is s.layout


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_a_link_inside_the_seam_is_recomputed_in_context(family):
    """The link segment is shorter than the seam, so the stitch recomputes it on top of the
    documents before it: with the seam covering every document too, composed is full."""
    model = tiny_model(family, tie_word_embeddings=True)
    s = linked()
    full = full_logits(model, s.layout, s.reply)
    assert (full - Composer(model, seam=64).logits(s.layout, s.reply)).abs().max().item() < 2e-4
    # at a seam of the link's length, each link still sees its own document: unlike a link
    # composed from its entry alone (seam 0), which does not
    near = kl(full, Composer(model, seam=len(LINK)).logits(s.layout, s.reply)).item()
    alone = kl(full, Composer(model, seam=0).logits(s.layout, s.reply)).item()
    assert near < alone


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_link_rows_train_alone_beside_lora_and_the_export_serves_with_the_link(family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hypic_core.models.registry import resolve

    base = tiny_model(family, tie_word_embeddings=True)
    base.save_pretrained(tmp_path / "base")
    cfg = TrainConfig(model=family, out=str(tmp_path), rank=4, seam=8, lr=1e-2, warmup=1, link="<a><b>")
    with pytest.raises(ValueError, match="link"):
        Trainer(cfg, copy.deepcopy(base))  # a link's text without its ids
    trainer = Trainer(cfg, copy.deepcopy(base), link=LINK)
    table = trainer.student.get_input_embeddings().weight
    assert any(p is table for p in trainer.params)
    s = linked()
    # the teacher (the base, adapters and rows off) reads the prompt without the link
    with torch.no_grad():
        plain = s.layout.without(LINK)
        ids = torch.tensor([plain.ids + list(s.reply)[:-1]])
        teacher = base(input_ids=ids, logits_to_keep=len(s.reply)).logits[0]
        assert torch.allclose(trainer._teacher_forward(ids, len(s.reply)), teacher, atol=1e-5)
    before = trainer.evaluate(s)
    for _ in range(8):
        trainer.train_step(s)
    after = trainer.evaluate(s)
    assert after[1] < before[1], (before, after)
    moved = (table.detach() - base.get_input_embeddings().weight).abs().amax(1)
    assert set(torch.nonzero(moved).flatten().tolist()) == set(LINK), "rows other than the link's changed"
    with trainer.tuning.disabled():
        assert torch.equal(table.detach(), base.get_input_embeddings().weight)
    assert trainer.evaluate(s) == after

    export_adapter(trainer, tmp_path / "adapter")
    tensors = load_file(tmp_path / "adapter" / "adapter.safetensors")
    assert tensors["model.embed_tokens.weight.row_ids"].tolist() == list(LINK)
    assert json.loads((tmp_path / "adapter" / "adapter.json").read_text())["link"] == "<a><b>"
    trainer.tuning.load_state({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})  # bf16, as shipped
    resolved = resolve(f"{tmp_path / 'base'}+{tmp_path / 'adapter'}", cache_dir=tmp_path / "cache")
    assert resolved.prompt["link"] == "<a><b>", "the merged model does not say it is served with its link"
    merged = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    ids = torch.tensor([linked(5).layout.ids])
    trainer.student.eval()
    with torch.no_grad():
        ref, out, untrained = trainer.student(input_ids=ids).logits, merged(input_ids=ids).logits, base(input_ids=ids).logits
    assert (ref - out).abs().max().item() < 1e-4
    assert (ref - untrained).abs().max().item() > 1e-3

    other = Trainer(cfg, copy.deepcopy(base), link=LINK)
    other.warm_start(tmp_path / "adapter")  # `hypic tune --init` continues rows and factors
    assert all(torch.equal(p, q) for p, q in zip(other.params, trainer.params))
    wrong = Trainer(TrainConfig(model=family, out=str(tmp_path), rank=4, seam=8, link="<c>"), copy.deepcopy(base), link=(5,))
    with pytest.raises(ValueError, match="link"):
        wrong.warm_start(tmp_path / "adapter")


def test_an_adapter_without_a_link_continues_with_one(tmp_path):
    """The third rung starts from the second's adapter: its factors load, the rows start unchanged."""
    base = tiny_model("bamba", tie_word_embeddings=True)
    plain = Trainer(TrainConfig(model="bamba", out=str(tmp_path), rank=4, seam=8, lr=1e-2, warmup=1), copy.deepcopy(base))
    plain.train_step(linked())
    export_adapter(plain, tmp_path / "adapter")
    more = Trainer(TrainConfig(model="bamba", out=str(tmp_path), rank=4, seam=8, link="<a><b>"), copy.deepcopy(base), link=LINK)
    more.warm_start(tmp_path / "adapter")
    assert torch.equal(more.student.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert more.step == 1


def test_link_rows_refuse_rows_of_another_link():
    rows = LinkRows(tiny_model("llama"), LINK)
    state = rows.state()
    state["model.embed_tokens.weight.row_ids"] = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="rows"):
        rows.load_state(state)


def test_a_link_is_written_with_special_tokens_that_have_no_role(tiny_tokenizer):
    from tokenizers import AddedToken

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<l0>", special=True), AddedToken("<l1>", special=True)]})
    assert link_ids(tok, "<l0><l1>") == tuple(tok.convert_tokens_to_ids(["<l0>", "<l1>"]))
    assert unused_specials(tok) == ["<l0>", "<l1>"]
    with pytest.raises(ValueError, match="used by the tokenizer or its chat template"):
        link_ids(tok, "<l0><|im_start|>")
    with pytest.raises(ValueError, match="not a special token"):
        link_ids(tok, "<l0> and text")
    with pytest.raises(ValueError, match="at least one"):
        link_ids(tok, "")


def test_the_prompter_writes_the_link_after_every_document(tiny_tokenizer):
    from tokenizers import AddedToken

    from app.service.prompter import GENERIC, Prompter
    from retrieval.document import Chunk, chunk_id_for
    from retrieval.index import SearchHit

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<l0>", special=True), AddedToken("<l1>", special=True)]})
    link = tuple(tok.convert_tokens_to_ids(["<l0>", "<l1>"]))
    texts = ["The river Alna flows through Varo.", "Its mayor is Ines Kell.", "The café opened in 1999."]
    hits = [SearchHit(float(i), Chunk(chunk_id_for(t), f"c{i}", "", "d", 0, t, 0)) for i, t in enumerate(texts)]
    plain = Prompter(tok, GENERIC["chat"], 4096)
    with_link = Prompter(tok, GENERIC["chat"].__class__(**{**GENERIC["chat"].__dict__, "link": "<l0><l1>"}), 4096)
    p, q = plain.query("Who is the mayor?", hits, 64), with_link.query("Who is the mayor?", hits, 64)
    assert q.exact_prefix == p.exact_prefix and q.used == p.used
    docs = q.segments[q.exact_prefix:-1]
    assert docs[1::2] == [link] * 3, "a link after every document"
    assert [q.segments[i] for i in sorted(q.places)] == docs[0::2]
    # leaving the links out gives the prompt without a link, token for token (what the teacher reads)
    assert [s for s in q.segments if s != link] == p.segments
    # the room a prompt leaves for documents counts their links
    fixed = sum(map(len, q.segments[: q.exact_prefix])) + len(q.segments[-1])
    need = sum(len(with_link.document(t)) for t in texts[1:]) + 2 * len(link)  # the best two (highest scores)
    assert len(with_link.query("Who is the mayor?", hits, reserve=4096 - fixed - need).used) == 2
    assert len(with_link.query("Who is the mayor?", hits, reserve=4096 - fixed - need + 1).used) == 1


def test_a_gateway_serving_a_linked_adapter_writes_the_link_after_every_document(tmp_path, monkeypatch):
    """`hypic serve --model 'BASE+ADAPTER'` with an adapter trained with a link: the merged model's
    stamp says so, and /query's prompt holds one link per document (its usage counts them)."""
    import httpx
    from safetensors.torch import save_file

    from app.http.server import create_app
    from app.service.prompter import Prompter
    from app.service.settings import Settings
    from app.testing import LiveServer, single_torch_thread
    from hypic_core.models.registry import resolve
    from retrieval import HashingEmbedder, VectorIndex
    from retrieval.document import Chunk, chunk_id_for
    from retrieval.index import SearchHit

    monkeypatch.setenv("HYPIC_MODELS_DIR", str(tmp_path / "models"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"model.embed_tokens.weight.row_delta": torch.full((1, 192), 0.01),
               "model.embed_tokens.weight.row_ids": torch.tensor([0])}, str(adapter / "adapter.safetensors"))
    (adapter / "adapter.json").write_text(json.dumps({"base": "hypic-tiny", "link": "<|endoftext|>"}))
    spec = f"hypic-tiny+{adapter}"
    docs = ["Seinaim is a city on the river Peiryas.", "Gripaith is a city on the river Nukreix."]
    settings = Settings(_env_file=None, model=spec, torch_threads=None, index_dir=tmp_path / "index", corpus_path=None)
    with single_torch_thread(), LiveServer(create_app(settings, index=VectorIndex(tmp_path / "index", HashingEmbedder(64)))) as live:
        live.wait_ready(timeout=120)
        body = "\n".join(json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(docs))
        r = httpx.post(f"{live.url}/documents", content=body, headers={"content-type": "application/jsonl"}, timeout=60)
        assert r.status_code == 201, r.text
        r = httpx.post(f"{live.url}/query", json={"question": "Which river flows through Seinaim?", "top_k": 2, "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
        used = r.json()["usage"]["prompt_tokens"]
    from transformers import AutoTokenizer

    model = resolve(spec)
    assert model.prompt["link"] == "<|endoftext|>"
    tok = AutoTokenizer.from_pretrained(model.path)
    plain = Settings(_env_file=None).prompt_layout(tok, model.known.prompt)
    hits = [SearchHit(float(i), Chunk(chunk_id_for(t), f"c{i}", "", "d", 0, t, 0)) for i, t in enumerate(docs)]
    without = Prompter(tok, plain, 4096).query("Which river flows through Seinaim?", hits, 64).tokens
    assert used == without + 2, (used, without)


def test_a_linked_adapter_s_model_card_names_its_link_and_how_to_train_it(tmp_path):
    from safetensors.torch import save_file

    from training.reuse.ship import ship

    run, target = tmp_path / "run", tmp_path / "model"
    (run / "adapter").mkdir(parents=True)
    save_file({"model.layers.0.self_attn.q_proj.lora_down": torch.zeros(2, 2), "model.layers.0.self_attn.q_proj.lora_up": torch.zeros(2, 2),
               "model.embed_tokens.weight.row_delta": torch.zeros(2, 2), "model.embed_tokens.weight.row_ids": torch.tensor([3, 4])},
              str(run / "adapter" / "adapter.safetensors"))
    card = {"base": "b", "teacher": "t", "rank": 4, "seam": 8, "step": 2, "cursor": 2, "train_seconds": 60.0, "lr": 3e-4,
            "precision": "fp32", "consistency": 10.0, "reply": "student", "data": "distill", "link": "<l0><l1>"}
    (run / "adapter" / "adapter.json").write_text(json.dumps(card))
    (run / "log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1, "kl_full": 0.01, "kl_composed": 0.02, "gap": 0.001,
                                                       "seconds": 10.0}) + "\n" for s in (1, 2)))
    text = (ship(run, target, "model") / "README.md").read_text()
    assert "LoRA (rank 4) on every attention layer's q projections, and the link `<l0><l1>`" in text
    assert "--rank 4 --link '<l0><l1>'" in text
