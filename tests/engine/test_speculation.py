"""Speculative decoding with prompt-lookup drafts (hypic_core/engine/drafting.py, runner/verify_step.py).

The golden rule: greedy outputs are identical, token for token, with and without speculation, on
every family (families the lean decode step does not cover do not speculate), across rows that
join and leave, aborts, stop strings and max_tokens. The verification forward itself is compared
with feeding the same tokens one at a time through the lean step (logits, and the conv, recurrent
and K/V state a row keeps). Tiny models run in float64 so that no near-tie can flip a token.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import engines
from conftest import random_segments
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.drafting import DraftBudget, DraftCost, PromptLookup
from hypic_core.engine.engine import Engine
from hypic_core.engine.sampling import Sampler
from hypic_core.errors import InvalidRequestError
from hypic_core.runner.verify_step import VerifyStep
from hypic_core.testing import FAMILIES, tiny_model

COVERED = ("llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba")  # families the lean step covers
MOE = ("qwen3_5_moe", "qwen3_next", "granitemoehybrid", "kimi_linear", "minimax")  # grouped expert matmuls: no float64


def model_of(family: str):
    return tiny_model(family, dtype=torch.float32 if family in MOE else torch.float64)
SHAPES = ((20, 9), (12, 30, 7), (5,), (8, 8, 8, 4), (25, 11))


# --- drafting ------------------------------------------------------------------------------------
def test_prompt_lookup_drafts_the_longest_latest_match_and_never_itself():
    pl = PromptLookup([5, 6, 7, 8, 1, 6, 7, 9, 2], max_n=3)
    assert pl.propose(3) == []  # the suffix (2) never occurred before
    pl.extend([6, 7])  # suffix (6, 7): latest earlier occurrence is followed by 9, 2
    assert pl.propose(3) == [9, 2, 6]
    pl.extend([8])  # (6, 7, 8) occurred once, followed by 1
    assert pl.propose(2) == [1, 6]
    assert pl.propose(0) == []
    assert PromptLookup([3, 3, 3]).propose(4) == [3]  # (3, 3) occurred at 0..1, followed by the last 3
    with pytest.raises(ValueError):
        PromptLookup([], max_n=0)


def test_draft_budget_drafts_what_acceptance_pays_for():
    b = DraftBudget(max_k=8, cost=0.3)
    assert b.next_k() == 1  # the prior (0.6)
    for _ in range(3):
        b.record(8, 8)  # copying: drafts grow to the cap
    assert b.rate > 0.9 and b.next_k() == 8
    b.record(8, 2)  # two kept, then a miss
    assert 0 < b.next_k() < 8
    for _ in range(6):
        b.record(1, 0)
    assert b.next_k() == 0  # not copying: no draft ...
    assert [b.next_k() for _ in range(8)] == [0] * 6 + [1, 0]  # ... but a one-token probe every 8 steps
    b.record(0, 0)  # nothing drafted: nothing learned
    assert b.rate < 0.3
    assert DraftBudget(cost=0.0, rate=0.2).next_k() == 8  # free tokens: always the longest draft
    assert DraftBudget(cost=2.0, rate=0.95).next_k() == 0  # dear tokens: never


def test_draft_cost_is_measured_per_batch_size_against_plain_steps():
    cost = DraftCost(0.3)
    cost.plain(1, 0.1)
    assert not cost.ready(1)
    cost.verify(1, 4, 0.2)  # one plain step is not a baseline yet: the prior stays
    assert cost.cost(1) == 0.3
    cost.plain(1, 0.1)
    assert cost.ready(1) and not cost.ready(8)
    for _ in range(40):
        cost.verify(1, 4, 0.3)  # 3x a plain step for 4 draft tokens: 0.5 a token
    assert abs(cost.cost(1) - 0.5) < 0.01
    for _ in range(2):
        cost.plain(8, 0.2)
    for _ in range(40):
        cost.verify(8, 10, 0.2)  # free: a GPU's few more rows
    assert cost.cost(8) < 0.01 and abs(cost.cost(1) - 0.5) < 0.01 and cost.cost(4) == 0.3
    # the result checked: 8 rows emitting 9 tokens in 0.2 s pay against plain steps (8 in 0.2 s)
    for _ in range(10):
        cost.verified(8, 9, 0.2)
    assert cost.pays(8)
    for _ in range(8):
        cost.verified(8, 9, 0.4)  # 9 tokens in 0.4 s against 8 in 0.2 s, 8 steps running: rest 32 steps, try again
    assert [cost.pays(8) for _ in range(33)] == [False] * 32 + [True]
    assert cost.pays(1)
    for _ in range(8):
        cost.verified(8, 9, 0.4)  # against again, straight after: rest twice as long
    assert [cost.pays(8) for _ in range(65)] == [False] * 64 + [True]
    fresh = DraftCost(0.3)
    for _ in range(2):
        fresh.plain(8, 0.2)
    for _ in range(8):
        fresh.verified(8, 9, 0.4)  # against: rest 32
    assert [fresh.pays(8) for _ in range(33)] == [False] * 32 + [True]
    for _ in range(8):
        fresh.verified(8, 9, 0.2)  # then in favour: the next rest is the first one again, not 64
    for _ in range(8):
        fresh.verified(8, 9, 0.4)
    assert [fresh.pays(8) for _ in range(33)] == [False] * 32 + [True]


# --- the verification forward against the lean step ------------------------------------------
def layer_buffers(batch) -> dict[str, list]:
    """The batch's row buffers by kind, through its public per-layer views: K/V at full capacity, the
    linear layers' conv and state rows of the running sequences."""
    n_attn, n_lin = batch.layer_counts
    kv = [batch.attention_layer(j) for j in range(n_attn)]
    lin = [batch.linear_layer(p) for p in range(n_lin)]
    return {"k": [x.keys for x in kv], "v": [x.values for x in kv], "conv": [x.conv for x in lin],
            "state": [x.state for x in lin]}


@pytest.mark.parametrize("family,kernel", [(f, "torch") for f in COVERED] + [("bamba", "native"), ("llama", "native")])
def test_verify_equals_token_by_token_and_keeps_exactly_the_prefix(family, kernel):
    """Three rows fed 3, 1 and 5 tokens at once: logits equal the lean step fed them one at a time,
    and after keeping 2, 1 and 4 of them every row's buffers equal the one-at-a-time batch's. On the
    native kernels (fp32) the Mamba2 layers verify stepped through the plain step's own update
    (decode_step.Mamba2._verify_stepped); on torch's ops in closed form."""
    if kernel == "native":
        from hypic_core.native.decode_matmul import native

        if native() is None:
            pytest.skip("no native kernels on this machine")
    model = model_of(family) if kernel == "torch" else tiny_model(family)
    atol = 1e-5 if kernel == "torch" else 1e-4  # softmax widths differ in the last bits; fp32 on the native kernels
    engine = engines.engine(4, model=model, decode_step="lean", decode_kernel=kernel)
    assert engine.runner.batch.step.kernel == kernel
    runner = engine.runner
    pre = [engine.prefill(GenerationRequest(random_segments(s, seed=i), mode="full")) for i, s in enumerate(SHAPES[:3])]
    fed = [[3, 17, 40], [9], [11, 12, 13, 14, 15]]
    kept = [2, 1, 4]
    with torch.inference_mode():
        ref = copy.deepcopy([p.cache for p in pre])
        runner.batch.sync([0, 1, 2], dict(enumerate(p.cache for p in pre)))
        verify = VerifyStep.build(runner.batch)
        assert verify is not None
        verified = verify.verify(runner.batch, fed, [p.position for p in pre])
        verify.commit(runner.batch, verified, kept)
        got = {name: [b.clone() for b in bufs] for name, bufs in layer_buffers(runner.batch).items()}
        lengths = list(runner.batch.lengths)
        runner.batch.sync([], {})
        # the reference: the same tokens one step at a time through the lean step, rows dropping out
        runner.batch.sync([0, 1, 2], dict(enumerate(ref)))
        pos = [p.position for p in pre]
        for t in range(max(map(len, fed))):
            live = [r for r in range(3) if t < len(fed[r])]
            runner.batch.sync(live, {})
            logits = runner.batch.forward([fed[r][t] for r in runner.batch.keys], [pos[r] + t for r in runner.batch.keys])
            for r, lg in zip(runner.batch.keys, logits):
                err = (lg - verified.logits[r, t]).abs().max().item()
                assert err < atol, f"{family} row {r} token {t}: {err:.3g}"
            if t + 1 in kept:  # row r's kept state is the one-at-a-time state after kept[r] tokens
                for r in [r for r in runner.batch.keys if kept[r] == t + 1]:
                    i = runner.batch.keys.index(r)
                    assert runner.batch.lengths[i] == lengths[r]
                    for name, bufs in got.items():
                        for j, buf in enumerate(bufs):
                            mine = buf[r] if name in ("conv", "state") else buf[r, :, :lengths[r]]
                            theirs = layer_buffers(runner.batch)[name][j][i]
                            theirs = theirs if name in ("conv", "state") else theirs[:, :lengths[r]]
                            assert torch.allclose(mine.double(), theirs.double(), atol=atol), f"{family} {name}[{j}] row {r}"
        runner.batch.sync([], {})


def test_commit_refuses_a_prefix_out_of_range():
    engine = engines.engine(8, "llama", decode_step="lean")
    pre = engine.prefill(GenerationRequest(random_segments((6,)), mode="full"))
    with torch.inference_mode():
        engine.runner.batch.sync(["a"], {"a": pre.cache})
        verify = VerifyStep.build(engine.runner.batch)
        verified = verify.verify(engine.runner.batch, [[1, 2]], [pre.position])
        for bad in ([0], [3], [1, 1]):
            with pytest.raises(ValueError):
                verify.commit(engine.runner.batch, verified, bad)
        engine.runner.batch.sync([], {})


# --- the engine: greedy outputs identical -------------------------------------------------------
def run(engine: Engine, requests, join_at: int = 2, abort_at: int | None = None) -> list[list]:
    """Add the first three requests, the rest at step `join_at`; abort request 1 at `abort_at`.
    Returns each request's outputs."""
    seqs = [engine.add_request(r, collect=True) for r in requests[:3]]
    for n in range(2000):
        if n == join_at:
            seqs += [engine.add_request(r, collect=True) for r in requests[3:]]
        if abort_at is not None and n == abort_at:
            seqs[1].abort.abort()
        if not engine.has_unfinished() and n > join_at:
            break
        engine.step()
    return [s.outbox for s in seqs]


def requests(stop: tuple[str, ...] = ()) -> list[GenerationRequest]:
    return [GenerationRequest(random_segments(s, seed=20 + i), mode=("hypic", "full", "prefix", "pic-naive", "hypic")[i],
                              sampling=SamplingParams(max_tokens=(40, 25, 33, 18, 30)[i], stop=stop, ignore_eos=i == 1))
            for i, s in enumerate(SHAPES)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_identical_with_and_without_speculation(family):
    model = model_of(family)
    outs, stats = {}, {}
    for spec in (False, True):
        engine = engines.engine(4, model=model, decode_step="lean", speculation=spec, speculation_min_ngram=1)
        outs[spec] = run(engine, requests(), abort_at=6)
        stats[spec] = engine.speculation
    for i, (a, b) in enumerate(zip(outs[False], outs[True])):
        assert [o.index for o in b] == list(range(len(b)))
        if i == 1:  # aborted at step 6: speculation may have produced more tokens by then, the same ones
            ta, tb = ([o.token_id for o in x if o.token_id is not None] for x in (a, b))
            assert ta == tb[:len(ta)] and a[-1].finish_reason == b[-1].finish_reason == "abort", f"{family}"
            continue
        assert [(o.token_id, o.text, o.finish_reason) for o in a] == [(o.token_id, o.text, o.finish_reason) for o in b], \
            f"{family} request {i}"
    assert stats[False].drafted == 0
    if family in COVERED:
        assert stats[True].verify_steps > 0 and stats[True].drafted > 0
    else:  # no lean step for it: no verification forward, nothing drafted
        assert stats[True].verify_steps == 0 and stats[True].drafted == 0


def test_stop_strings_and_max_tokens_cut_inside_an_accepted_draft(tiny_tokenizer):
    """Text models repeat; a stop string or max_tokens lands inside a run of accepted drafts: the output
    ends exactly where plain decoding ends it."""
    model = tiny_model("qwen3_5", vocab_size=len(tiny_tokenizer), dtype=torch.float64)
    prompt = tuple(tiny_tokenizer.encode("The river Alna flows through Varo. The river Alna flows through Varo. The river"))
    base = engine_out = None
    for spec in (False, True):
        engine = engines.engine(4, model=model, tokenizer=tiny_tokenizer, decode_step="lean", speculation=spec,
                                speculation_min_ngram=1)
        plain = list(engine.generate(GenerationRequest((prompt,), mode="full", sampling=SamplingParams(max_tokens=30))))
        text = "".join(o.text for o in plain)
        stop = text[len(text) // 2: len(text) // 2 + 3] if len(text) > 6 else None
        cut = [list(engine.generate(GenerationRequest((prompt,), mode="full", sampling=SamplingParams(max_tokens=n))))
               for n in (1, 7, 13)]
        stopped = list(engine.generate(GenerationRequest((prompt,), mode="full",
                                                         sampling=SamplingParams(max_tokens=30, stop=(stop,) if stop else ()))))
        result = [[(o.token_id, o.text, o.finish_reason) for o in run_] for run_ in (plain, *cut, stopped)]
        if spec:
            engine_out = (result, engine.speculation)
        else:
            base = result
    assert engine_out[0] == base
    assert [len(r) for r in base[1:4]] == [1, 7, 13]


class FixedBudget:
    """Always 8 tokens (the drafts above decide)."""

    def next_k(self):
        return 8

    def record(self, drafted, accepted):
        pass


class FixedDrafter:
    """A drafter that proposes given tokens (to pin a draft rejected at its first token, and one
    accepted whole): the engine's `PromptLookup` interface."""

    def __init__(self, seq, drafts):
        self.tokens = [t for seg in seq.request.segments for t in seg]
        self.drafts = drafts

    def extend(self, tokens):
        self.tokens += list(tokens)

    def propose(self, k):
        return self.drafts.pop(0)[:k] if self.drafts else []


@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "llama"])
def test_a_draft_rejected_at_its_first_token_and_one_accepted_whole(family):
    model = tiny_model(family, dtype=torch.float64)
    req = GenerationRequest(random_segments((14, 9), seed=3), mode="full", sampling=SamplingParams(max_tokens=20, ignore_eos=True))
    plain = engines.engine(8, model=model, decode_step="lean", speculation=False).generated_tokens(req)
    engine = engines.engine(8, model=model, decode_step="lean", speculation=True)
    seq = engine.add_request(req, collect=True)
    wrong = (plain[3] + 1) % 300  # plain[3] comes next: the draft misses at once
    # step 1 samples plain[0]; steps 2-3 decode plainly (the engine times plain steps of one row first);
    # step 4 feeds plain[2] with the draft [wrong, ...]: rejected at once, emits plain[3];
    # step 5 feeds plain[3] with plain[4:8]: accepted whole, emits plain[4:9]
    seq.drafter = FixedDrafter(seq, [[wrong, plain[4]], plain[4:8]])
    seq.draft_budget = FixedBudget()
    counts = []
    while engine.has_unfinished():
        counts.append(sum(1 for o in engine.step() if o.token_id is not None))
    got = [o.token_id for o in seq.outbox if o.token_id is not None]
    assert got == plain
    assert counts[:5] == [1, 1, 1, 1, 5]  # the rejected draft gave one token, the one accepted whole five
    assert engine.speculation.drafted == 6 and engine.speculation.accepted == 4


def test_per_request_field_overrides_the_engine():
    model = tiny_model("llama", dtype=torch.float64)
    reqs = requests()
    off = engines.engine(8, model=model, decode_step="lean", speculation=False)
    on = [GenerationRequest(r.segments, r.mode, sampling=r.sampling, speculation=True) for r in reqs]
    run(off, on)
    assert off.speculation.drafted > 0
    engine = engines.engine(8, model=model, decode_step="lean", speculation=True)
    run(engine, [GenerationRequest(r.segments, r.mode, sampling=r.sampling, speculation=False) for r in reqs])
    assert engine.speculation.drafted == 0
    with pytest.raises(InvalidRequestError, match="speculation"):
        GenerationRequest(reqs[0].segments, speculation="yes")
    with pytest.raises(InvalidRequestError, match="speculation_max_draft"):
        EngineConfig(speculation_max_draft=0)


# --- sampling: the rejection rule keeps the distribution --------------------------------------------
def test_sampling_with_a_draft_keeps_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.8, top_k=4, seed=1)
    p = torch.softmax(torch.where(logits >= 0.0, logits, float("-inf")) / 0.8, dim=-1)
    n = 20000
    for draft in (0, 2, 4):  # a likely, an unlikely and an impossible (top-k cut) draft
        sampler = Sampler(params)
        counts = collections.Counter(sampler(logits, draft=draft).token_id for _ in range(n))
        freq = torch.tensor([counts[i] / n for i in range(5)])
        assert (freq - p).abs().max() < 0.015, (draft, freq, p)
    greedy = Sampler(SamplingParams())
    assert greedy(logits, draft=3).token_id == 0  # greedy ignores the draft


# --- the real models ---------------------------------------------------------------------------
PASSAGE = ("The Alna is a river that flows through the city of Varo. The mayor of Varo is Ines Kell, "
           "who was elected in 2019. Brill is a company founded by Tam Oke in 1999 in Varo.")


class SteadyCost(DraftCost):
    """DraftCost with the measured price held at its prior and no resting: what it decides then depends on
    the drafts' acceptance alone, not on step timings (which a loaded machine makes erratic)."""

    def plain(self, rows: int, seconds: float) -> None:
        self._plain[rows] = (2, 1.0)

    def verify(self, rows: int, drafted: int, seconds: float) -> None:
        pass

    def verified(self, rows: int, tokens: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "smollm2-hybrid-135m"])
def test_real_models_answer_identically_with_fewer_steps(name, smollm2_dir):
    """SmolLM2 and its hybrid asked to copy from a passage: the same 40 greedy tokens with speculation,
    most of them from accepted drafts."""
    from hypic_core.models.registry import resolve

    torch.set_num_threads(1)
    engine = Engine.from_pretrained(resolve(name).path, EngineConfig(seam=4, decode_step="lean", speculation=False))
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": f"{PASSAGE}\n\nRepeat the text above word for word."}]
    prompt = tuple(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    req = GenerationRequest((prompt,), mode="full", sampling=SamplingParams(max_tokens=40, ignore_eos=True))
    plain = engine.generated_tokens(req)
    engine.config = EngineConfig(seam=4, decode_step="lean", speculation=True)
    engine.speculator.cost = SteadyCost(0.3)  # the drafts' yield is under test here, not this machine's load
    steps = 0
    seq = engine.add_request(req, collect=True)
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert [o.token_id for o in seq.outbox] == plain
    assert engine.speculation.accepted >= 10 and steps < 35, (engine.speculation, steps)


# --- the gateway -------------------------------------------------------------------------------
def test_gateway_answers_the_same_with_speculation_and_counts_it(tiny_tokenizer, tmp_path):
    """/query with `speculation` true and false: the same greedy answer, streamed and not, the same usage;
    /metrics counts drafted and accepted tokens; a malformed field is a 400 naming it."""
    import json

    import httpx

    from app.http.server import create_app
    from app.service.settings import Settings
    from app.testing import LiveServer, single_torch_thread
    from retrieval import HashingEmbedder, VectorIndex

    corpus = [{"id": "varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."},
              {"id": "brill", "title": "Brill", "text": "Brill is a company founded by Tam Oke in 1999."}]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    settings = Settings(_env_file=None, torch_threads=None, index_dir=tmp_path / "index", corpus_path=tmp_path / "corpus.jsonl")
    engine = engines.engine(4, tokenizer=tiny_tokenizer, model_id="tiny", decode_step="lean", speculation_min_ngram=1)
    engine.eos_ids = frozenset()  # answers run to max_tokens
    app = create_app(settings, engine=engine, index=VectorIndex(settings.index_dir, HashingEmbedder(64)))
    body = {"question": "Who is the mayor of Varo?", "top_k": 2, "max_tokens": 48}
    with single_torch_thread(), LiveServer(app) as g:
        g.wait_ready()
        with httpx.Client(base_url=g.url, timeout=60) as c:
            off = c.post("/query", json={**body, "speculation": False}).json()
            on = c.post("/query", json={**body, "speculation": True}).json()
            with c.stream("POST", "/query", json={**body, "speculation": True, "stream": True}) as r:
                streamed = "".join(json.loads(line[5:]).get("text", "") for line in r.iter_lines()
                                   if line.startswith("data:") and '"text"' in line)
            bad = c.post("/query", json={**body, "speculation": "sometimes"})
            metrics = c.get("/metrics").text
    assert on["answer"] == off["answer"] == streamed
    assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"] == 48
    assert bad.status_code == 400 and "speculation" in bad.text
    drafted = float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("hypic_speculation_drafted_tokens_total")))
    assert drafted == engine.speculation.drafted > 0
    assert "hypic_speculation_accepted_tokens_total" in metrics
