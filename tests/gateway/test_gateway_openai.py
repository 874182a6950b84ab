"""The OpenAI-compatible endpoints, driven by the official `openai` client against a live server."""

from __future__ import annotations

import openai
import pytest

import gateways

CORPUS = [
    {"id": "city-varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."},
    {"id": "firm-brill", "text": "Brill is a company founded by Tam Oke in 1999."},
    {"id": "river-alna", "text": "The Alna is a river that flows into the sea near Varo."},
]
HELLO = [{"role": "user", "content": "Who founded Brill?"}]


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    with gateways.gateway(tmp_path_factory.mktemp("gateway-openai"), tiny_tokenizer, CORPUS, max_new_tokens=64) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, temperature=0, presence_penalty=0,
                                       user="someone", response_format={"type": "text"})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert 1 <= r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming_and_reports_usage(client):
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streaming_without_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy picks the top token
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token or "\ufffd" in entry.token
    streamed = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_token_bytes_are_exact_for_partial_characters(tiny_tokenizer):
    from app.service.tokens import TokenText

    tokens = TokenText(tiny_tokenizer)
    ids = tiny_tokenizer.encode("naïve émigrés café", add_special_tokens=False)
    assert b"".join(bytes(tokens.bytes(i)) for i in ids) == "naïve émigrés café".encode()
    partial = [i for i in range(len(tiny_tokenizer)) if "\ufffd" in tokens.text(i)]
    assert partial and all(tokens.bytes(i) != list("\ufffd".encode()) for i in partial)


def test_completions_stream_and_logprobs(client):
    kwargs = dict(model="tiny", prompt="The river Alna flows", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and isinstance(choice.text, str)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_rag_extra_field_adds_retrieved_chunks_and_reuses_them(client):
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, temperature=0)
    rag = dict(model="tiny", messages=HELLO, max_tokens=2, temperature=0, extra_body={"rag": {"top_k": 2}})
    first = client.chat.completions.create(**rag)
    again = client.chat.completions.create(**rag)
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens
    # the chunks' bodies are reused by composition; exact reuse (cached_tokens) is the system prompt's alone
    assert again.usage.prompt_tokens_details.composed_tokens > 0 == plain.usage.prompt_tokens_details.composed_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens_details.cached_tokens
    only = client.chat.completions.create(**{**rag, "extra_body": {"rag": {"top_k": 5, "document_ids": ["firm-brill"]}}})
    assert only.usage.prompt_tokens < first.usage.prompt_tokens  # one document instead of two


def test_explicit_segments_are_cached_independently(client):
    docs = ["Segment one says Varo is old.", "Segment two says Brill is new."]
    first = client.completions.create(model="tiny", prompt="Which is new?", max_tokens=2, extra_body={"segments": docs})
    swapped = client.completions.create(model="tiny", prompt="Which is new?", max_tokens=2,
                                        extra_body={"segments": docs[::-1]})
    assert first.usage.prompt_tokens == swapped.usage.prompt_tokens
    details = swapped.usage.prompt_tokens_details
    assert details.composed_tokens > 0 and details.cached_tokens == 0  # reused in another position: composed, not exact
    whole = client.completions.create(model="tiny", prompt="Which is new?", max_tokens=2,
                                      extra_body={"segments": docs[::-1], "recompute": 1.0})
    assert whole.usage.prompt_tokens_details.composed_tokens == 0  # the same entries, every segment recomputed in context


@pytest.mark.parametrize("kwargs,error,param", [
    (dict(model="gpt-4"), openai.NotFoundError, "model"),
    (dict(n=2), openai.BadRequestError, "n"),
    (dict(top_logprobs=30, logprobs=True), openai.BadRequestError, "top_logprobs"),
    (dict(top_logprobs=2), openai.BadRequestError, "top_logprobs"),
    (dict(temperature=3), openai.BadRequestError, "temperature"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(max_tokens=10_000), openai.BadRequestError, "max_tokens"),
    (dict(messages=[]), openai.BadRequestError, "messages"),
    (dict(messages=[{"role": "assistant", "content": "hi"}]), openai.BadRequestError, "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), openai.BadRequestError, "messages[0].role"),
    (dict(messages=[{"role": "user", "content": 5}]), openai.BadRequestError, "messages[0].content"),
    (dict(messages=[{"role": "user"}]), openai.BadRequestError, "messages[0].content"),
    (dict(extra_body={"rag": {"top_k": 0}}), openai.BadRequestError, "rag.top_k"),
    (dict(extra_body={"rag": {"document_ids": ["nope"]}}), openai.BadRequestError, "rag.document_ids"),
    (dict(extra_body={"mode": "bogus"}), openai.BadRequestError, "mode"),
    (dict(extra_body={"recompute": -0.1}), openai.BadRequestError, "recompute"),
    (dict(messages=[{"role": "user", "content": "Varo " * 3000}]), openai.BadRequestError, "messages"),
    (dict(presence_penalty=0.5), openai.BadRequestError, "presence_penalty"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), openai.BadRequestError, "tools"),
    (dict(response_format={"type": "json_object"}), openai.BadRequestError, "response_format"),
], ids=["unknown-model", "n", "top_logprobs-range", "top_logprobs-without-logprobs", "temperature", "max_tokens-zero",
        "max_tokens-too-big", "no-messages", "last-not-user", "bad-role", "content-type", "content-missing", "rag-top_k", "rag-unknown-document",
        "mode", "recompute", "prompt-too-long", "presence_penalty", "tools", "response_format"])
def test_chat_bad_input_names_the_field(client, kwargs, error, param):
    with pytest.raises(error) as caught:
        client.chat.completions.create(**{"model": "tiny", "messages": HELLO, "max_tokens": 2, **kwargs})
    assert caught.value.body["param"] == param and caught.value.body["message"].startswith(param)


@pytest.mark.parametrize("kwargs,param", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=["a", "b"]), "prompt"),
    (dict(echo=True), "echo"),
    (dict(logprobs=50), "logprobs"),
    (dict(prompt=123), "prompt"),
    (dict(extra_body={"segments": "not a list"}), "segments"),
], ids=["empty-prompt", "two-prompts", "echo", "logprobs-range", "prompt-type", "segments-type"])
def test_completions_bad_input_names_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"model": "tiny", "prompt": "x", "max_tokens": 2, **kwargs})
    assert caught.value.body["param"] == param
