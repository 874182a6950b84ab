"""The Sampler's vLLM-compatible extras (repetition penalty, banned tokens, top-k, min-p) against
plain reference computations, SamplingParams validation, and the API fields that carry them."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from hypic_core.config import SamplingParams
from hypic_core.engine.sampling import Sampler
from hypic_core.errors import InvalidRequestError

VOCAB = 50_000


def big_logits(seed: int, n: int = VOCAB) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


# --- reference implementations ----------------------------------------------------------------

def old_probs(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """The Sampler's distribution before the extras existed (temperature, top-k, top-p), verbatim."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def old_pick(params: SamplingParams, logits: torch.Tensor, generator: torch.Generator) -> int:
    """The Sampler's choice before the extras existed: greedy, or a draw from `old_probs`."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(old_probs(params, logits), 1, generator=generator))


def penalised(logits: torch.Tensor, history, penalty: float) -> torch.Tensor:
    """vLLM's repetition penalty, one token id at a time."""
    out = logits.clone()
    for t in set(int(t) for t in history):
        if 0 <= t < out.numel():
            out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def reference_pick(params: SamplingParams, logits: torch.Tensor, generator: torch.Generator,
                   history=(), banned=()) -> int:
    """Penalty, bans, then temperature / top-k / top-p as before, then min-p."""
    logits = penalised(logits, history, params.repetition_penalty)
    for t in banned:
        logits[t] = float("-inf")
    if params.greedy or params.min_p == 0.0:
        return old_pick(params, logits, generator)
    probs = old_probs(params, logits)
    probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


# --- defaults: unchanged behaviour ------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, top_k=200, top_p=0.8), dict(temperature=1.0, top_logprobs=5),
], ids=["greedy", "t1", "top_k", "top_p", "top_k+top_p", "top_logprobs"])
def test_defaults_are_bit_identical_to_the_old_sampler(kwargs):
    params = SamplingParams(seed=7, **kwargs)
    sampler = Sampler(params)
    generator = torch.Generator().manual_seed(7)
    for step in range(40):
        logits = big_logits(step)
        before = logits.clone()
        history = () if step % 2 else tuple(range(0, VOCAB, 97))  # ignored with repetition_penalty 1
        choice = sampler(logits, history=history, banned=())
        expected = old_pick(params, logits, generator)
        assert choice.token_id == expected
        logprobs = torch.log_softmax(logits, dim=-1)
        assert choice.logprob == float(logprobs[expected])
        if params.top_logprobs:
            vals, idx = logprobs.topk(params.top_logprobs)
            assert choice.top_logprobs == tuple(zip(idx.tolist(), vals.tolist()))
        assert torch.equal(logits, before)


def test_a_call_without_extras_is_the_same_as_with_empty_extras():
    a, b = Sampler(SamplingParams(temperature=1.0, seed=3)), Sampler(SamplingParams(temperature=1.0, seed=3))
    for step in range(20):
        logits = big_logits(step)
        assert a(logits) == b(logits, (), ())


# --- repetition penalty -----------------------------------------------------------------------

def test_repetition_penalty_flips_greedy_choices():
    greedy = lambda penalty, logits, history: Sampler(SamplingParams(repetition_penalty=penalty))(  # noqa: E731
        torch.tensor(logits), history).token_id
    # a positive logit is divided: 3.0 / 1.5 = 2.0 < 2.5
    assert greedy(1.0, [3.0, 2.5, -1.0], [0]) == 0
    assert greedy(1.5, [3.0, 2.5, -1.0], [0]) == 1
    assert greedy(1.1, [3.0, 2.5, -1.0], [0]) == 0  # 2.73 > 2.5
    # a negative logit is multiplied: -1.0 * 1.5 = -1.5 < -1.2
    assert greedy(1.5, [-1.0, -1.2, -5.0], [0]) == 1
    assert greedy(1.1, [-1.0, -1.2, -5.0], [0]) == 0  # -1.1 > -1.2
    # penalty < 1 favours seen tokens: 2.0 / 0.5 = 4.0 > 2.5
    assert greedy(0.5, [2.0, 2.5, 0.0], [0]) == 0
    # tokens of the prompt and of the output count alike, and once however often they appear
    assert greedy(1.5, [3.0, 2.5, 2.4], [0, 1]) == 2
    assert greedy(1.5, [3.0, 2.5, 2.1], [0, 0, 0, 0]) == 1  # 2.0, not 3.0 / 1.5**4
    # ids outside the vocabulary are ignored
    assert greedy(1.5, [3.0, 2.5], [7, -1]) == 0


def test_repetition_penalty_matches_the_reference_transformation():
    logits = big_logits(11)
    history = torch.randint(0, VOCAB, (3000,), generator=torch.Generator().manual_seed(1)).tolist() + [VOCAB + 5]
    for penalty in (0.7, 1.3, 2.0):
        sampler = Sampler(SamplingParams(repetition_penalty=penalty))
        assert torch.equal(sampler._process(logits.float(), history, ()), penalised(logits, history, penalty))
        assert torch.equal(sampler._process(logits.float(), torch.tensor(history), ()), penalised(logits, history, penalty))


@pytest.mark.parametrize("kwargs", [
    dict(repetition_penalty=1.4), dict(repetition_penalty=0.8, temperature=1.0),
    dict(repetition_penalty=1.2, temperature=0.8, top_k=40, top_p=0.95),
], ids=["greedy", "sampled", "sampled-top_k-top_p"])
def test_repetition_penalty_sampling_matches_the_reference(kwargs):
    params = SamplingParams(seed=5, **kwargs)
    sampler, generator = Sampler(params), torch.Generator().manual_seed(5)
    history = list(range(0, 400, 3))
    for step in range(40):
        logits = big_logits(100 + step, 2000)
        choice = sampler(logits, history)
        assert choice.token_id == reference_pick(params, logits, generator, history)
        assert choice.logprob == float(torch.log_softmax(logits, -1)[choice.token_id])  # unprocessed
        history.append(choice.token_id)


def test_repetition_penalty_leaves_the_callers_logits_alone():
    logits = torch.tensor([3.0, 2.5, -1.0])
    Sampler(SamplingParams(repetition_penalty=2.0))(logits, [0, 2], [1])
    assert logits.tolist() == [3.0, 2.5, -1.0]


# --- banned tokens ----------------------------------------------------------------------------

def test_banned_tokens_are_never_chosen_greedily():
    logits = torch.tensor([1.0, 5.0, 4.0, 0.5])
    sampler = Sampler(SamplingParams(top_logprobs=2))
    choice = sampler(logits, banned={1})
    assert choice.token_id == 2
    assert choice.logprob == float(torch.log_softmax(logits, -1)[2])  # the model's, not renormalised
    assert choice.top_logprobs[0][0] == 1  # the banned token is still reported as the model's top
    assert sampler(logits, banned=frozenset({1, 2})).token_id == 0
    assert sampler(logits, banned=[1, 2, 99]).token_id == 0  # ids outside the vocabulary are ignored


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=2.0, top_k=3),
                                    dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, min_p=0.01)],
                         ids=["t1", "top_k", "top_p", "min_p"])
def test_banned_tokens_are_never_sampled(kwargs):
    logits = big_logits(3, 1000)
    banned = frozenset(logits.topk(2).indices.tolist()) | {17}  # the two likeliest and one other
    sampler = Sampler(SamplingParams(seed=0, **kwargs))
    drawn = {sampler(logits, banned=banned).token_id for _ in range(500)}
    assert drawn and not drawn & banned


def test_top_k_one_with_the_top_token_banned_takes_the_next():
    logits = big_logits(4, 1000)
    first, second = logits.topk(2).indices.tolist()
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))
    assert {sampler(logits, banned=(first,)).token_id for _ in range(20)} == {second}


def test_every_token_banned_is_an_error():
    with pytest.raises(ValueError, match="banned"):
        Sampler(SamplingParams())(torch.zeros(3), banned=(0, 1, 2))


# --- top-k, min-p -----------------------------------------------------------------------------

def test_top_k_samples_only_the_k_most_likely():
    logits = big_logits(5) / 6  # flat enough that many tokens get drawn
    top = set(logits.topk(10).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=10, seed=0))
    drawn = {sampler(logits).token_id for _ in range(600)}
    assert drawn == top


def test_min_p_drops_tokens_below_the_threshold():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=0))  # keeps p >= 0.12
    assert {sampler(probs.log()).token_id for _ in range(500)} == {0, 1, 2}
    plain = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert {plain(probs.log()).token_id for _ in range(500)} == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_min_p_over_a_large_vocabulary(temperature):
    logits = big_logits(6)
    min_p = 0.02
    probs = torch.softmax(logits / temperature, -1)  # min-p applies after temperature
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    params = SamplingParams(temperature=temperature, min_p=min_p, seed=1)
    sampler, generator = Sampler(params), torch.Generator().manual_seed(1)
    drawn = set()
    for _ in range(400):
        token = sampler(logits).token_id
        assert token == reference_pick(params, logits, generator)
        drawn.add(token)
    assert drawn <= allowed and len(drawn) > 1


def test_min_p_one_keeps_only_the_most_likely():
    logits = big_logits(8, 500)
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=0))
    assert {sampler(logits).token_id for _ in range(50)} == {int(logits.argmax())}


def test_all_extras_together_match_the_reference():
    params = SamplingParams(temperature=0.9, top_k=100, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=9)
    sampler, generator = Sampler(params), torch.Generator().manual_seed(9)
    history = list(range(0, 200, 7))
    for step in range(60):
        logits = big_logits(200 + step, 3000)
        banned = (int(logits.argmax()), 3) if step % 3 == 0 else ()
        choice = sampler(logits, history, banned)
        assert choice.token_id == reference_pick(params, logits, generator, history, banned)
        history.append(choice.token_id)


# --- SamplingParams ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=1.5), "min_tokens"), (dict(min_tokens=True), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.01), "min_p"),
    (dict(min_p=float("nan")), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(top_k=-1), "top_k"), (dict(seed=2**64), "seed"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
])
def test_sampling_params_reject_bad_extras(kwargs, field):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.field == field and str(caught.value).startswith(field)


def test_seeds_span_64_bits():
    """0 and 2**64 - 1 are both seeds torch takes; the same seed samples the same tokens."""
    logits = big_logits(7, 3000)
    for seed in (0, 2**64 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert Sampler(params)(logits).token_id == Sampler(params)(logits).token_id


def test_sampling_params_accept_valid_extras():
    p = SamplingParams(max_tokens=8, min_tokens=8, min_p=1.0, repetition_penalty=0.5, ignore_eos=True, top_k=3)
    assert (p.min_tokens, p.min_p, p.repetition_penalty, p.ignore_eos, p.top_k) == (8, 1.0, 0.5, True, 3)
    d = SamplingParams()
    assert (d.ignore_eos, d.min_tokens, d.min_p, d.repetition_penalty, d.top_k) == (False, 0, 0.0, 1.0, 0)


# --- API --------------------------------------------------------------------------------------

CORPUS = [{"id": "firm-brill", "text": "Brill is a company founded by Tam Oke in 1999."},
          {"id": "city-varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Who founded Brill?"}], "max_tokens": 3}
COMPLETION = {"model": "tiny", "prompt": "The river Alna", "max_tokens": 3}
QUERY = {"question": "Who founded Brill?", "top_k": 1, "max_tokens": 3}


@pytest.fixture(scope="module")
def gateway(tiny_tokenizer, tmp_path_factory):
    import gateways
    from app.testing import tiny_gateway

    app = tiny_gateway(tmp_path_factory.mktemp("gateway-sampling"), tiny_tokenizer, CORPUS, max_new_tokens=32)
    with gateways.served(app) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        yield app, client


BAD = [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.2}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 4}, "min_tokens"),  # more than max_tokens (3)
    ({"ignore_eos": "maybe"}, "ignore_eos"),
]


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)], ids=["chat", "completions"])
@pytest.mark.parametrize("extra,param", BAD, ids=[f"{p}={list(e.values())[0]}" for e, p in BAD])
def test_openai_bad_extras_are_400_naming_the_field(gateway, path, base, extra, param):
    r = gateway[1].post(path, json=base | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)], ids=["chat", "completions"])
def test_openai_infinite_penalty_is_400(gateway, path, base):
    body = json.dumps(base)[:-1] + ', "repetition_penalty": Infinity}'
    r = gateway[1].post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


@pytest.mark.parametrize("extra", [
    {"top_k": -1}, {"top_k": 0}, {"top_k": 5, "temperature": 1.0, "seed": 1}, {"min_p": 0.1, "temperature": 1.0, "seed": 4},
    {"repetition_penalty": 1.3}, {"repetition_penalty": 0.9, "temperature": 0.8, "seed": 2}, {"min_tokens": 2},
    {"ignore_eos": True}, {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 3, "ignore_eos": False,
                           "temperature": 0.7, "top_p": 0.9, "seed": 3},
], ids=["top_k-off", "top_k-zero", "top_k", "min_p", "penalty", "penalty-sampled", "min_tokens", "ignore_eos", "all"])
@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)], ids=["chat", "completions"])
def test_openai_valid_extras_are_accepted(gateway, path, base, extra):
    # mode pinned: left to the accuracy guard, the serving mode (and so whether the tiny model's greedy
    # first token is EOS) would depend on when the guard last ran its checks. Seeded: the OpenAI default
    # temperature is 1, and the tiny model's next-token distribution is near uniform over ~300 ids, so an
    # unseeded draw picks a stop token first about once in 150 requests (0 tokens; seen in CI).
    r = gateway[1].post(path, json=base | {"seed": 11} | extra | {"mode": "full"})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 3


def test_openai_extras_reach_the_sampling_params(gateway):
    from app.http import api_openai
    from app.service.prompter import Prompt
    from app.service.tenants import DEFAULT_TENANT

    app, _ = gateway
    rt = app.state.runtime
    body = api_openai.ChatRequest(**CHAT, top_k=-1, min_p=0.2, repetition_penalty=1.5, min_tokens=2, ignore_eos=True)
    sampling = api_openai._generation(rt, body, Prompt([(5, 6, 7)], [], 0), 3, False, 0, DEFAULT_TENANT).sampling
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty, sampling.min_tokens, sampling.ignore_eos) == (
        0, 0.2, 1.5, 2, True)
    body = api_openai.CompletionRequest(**COMPLETION, top_k=7)
    sampling = api_openai._generation(rt, body, Prompt([(5, 6, 7)], [], 0), 3, False, 0, DEFAULT_TENANT).sampling
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty, sampling.min_tokens, sampling.ignore_eos) == (
        7, 0.0, 1.0, 0, False)


QUERY_BAD = [b for b in BAD if b[1] != "top_k"]


@pytest.mark.parametrize("extra,param", QUERY_BAD, ids=[f"{p}={list(e.values())[0]}" for e, p in QUERY_BAD])
def test_query_bad_extras_are_400_naming_the_field(gateway, extra, param):
    r = gateway[1].post("/query", json=QUERY | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_query_accepts_the_extras(gateway):
    r = gateway[1].post("/query", json=QUERY | {"min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1,
                                                "ignore_eos": True, "temperature": 0.8, "seed": 4})
    assert r.status_code == 200, r.text
    r = gateway[1].get("/query", params={"question": "Who founded Brill?", "max_tokens": 2, "repetition_penalty": 1.2,
                                         "stream": False})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra", [{"temperature": 1e-40}, {"temperature": 1e-46}, {"top_p": 1e-46},
                                   {"top_p": 5e-324}, {"repetition_penalty": 1e-50}, {"repetition_penalty": 5e-324}])
def test_tiny_sampling_values_still_pick_a_token(extra):
    """Valid but tiny values once overflowed to NaN probabilities; their limit is picked instead."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(**({"temperature": 1.0, "seed": 3} | extra))
    choice = Sampler(params)(logits, history=list(range(0, 64, 2)))
    assert 0 <= choice.token_id < 64
    if "temperature" in extra:  # the limit of a vanishing temperature is greedy
        assert choice.token_id == int(logits.argmax())
