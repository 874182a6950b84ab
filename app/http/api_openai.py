"""OpenAI-compatible endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Request and response shapes follow the OpenAI API, so any OpenAI client works by changing its
base URL. Supported: stream (chunks, final `finish_reason`, `data: [DONE]`; `: keep-alive`
comments fill silences),
`stream_options.include_usage`, `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`,
`seed`, `stop`, `logprobs` / `top_logprobs` (chat) and `logprobs: int` (completions), `n = 1`,
and vLLM's sampling extras `top_k` (-1 or 0: off), `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`. Cache reuse is reported in `usage.prompt_tokens_details`: `cached_tokens` counts
exact reuse only (an exact prefix, as OpenAI and vLLM mean it); `composed_tokens` the tokens
reused by position-independent composition (approximate); `seam_tokens` those recomputed at joins.

Extra fields: `rag: {top_k, document_ids}` retrieves chunks for the last user message (chat) or
the prompt (completions) and adds them as segments; the response then carries `sources` (the
chunks used, best first, as in /query) and `dropped_chunks` (chunks left out because they did
not fit the context) at its top level, in a stream on the first chunk; `segments: [text, ...]` are cached
independently (chat: placed before the last user message, like retrieved documents;
completions: before the prompt, verbatim); `mode`, `seam`, `recompute` and `exact` as in /query; `rag.collections`
names the tenant's collections to retrieve from; `cache: {"store": false}` keeps nothing of the
request in the cache; OpenAI's `prompt_cache_key` is accepted as a grouping hint (a string) and
never widens what is shared: the cache is always the key's tenant's. Without `rag` or
`segments`, a chat is plain chat. Fields this server cannot honour (`tools`, `logit_bias`,
penalties, `response_format` other than text, ...) are refused with a 400 naming them when
they ask for something; other unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hypic_core.config import MAX_SEED
from hypic_core.engine.sequence import StepOutput

from ..service import pipeline

from ..service.engine_thread import TokenStream
from ..service.prompter import Prompt
from ..service.runtime import Runtime
from ..service.tenants import cache_salt
from . import schemas, sse
from .api_query import mode_named
from .errors import APIError, from_stream_failure, shown
from .generation import CacheOptions, SamplingExtras, collect
from .tenancy import tenant_of
from .routing import StrictJSONRoute

log = logging.getLogger("hypic.openai")
router = APIRouter(prefix="/v1", route_class=StrictJSONRoute)


class RagOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    top_k: int | None = Field(None, ge=1)
    document_ids: list[str] | None = None
    collections: list[str] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# OpenAI fields this server cannot honour, with the values that ask for nothing (accepted).
UNSUPPORTED = {"tools": ([], None), "functions": ([], None), "tool_choice": ("none", "auto", None),
               "function_call": ("none", "auto", None), "logit_bias": ({}, None), "presence_penalty": (0, None),
               "frequency_penalty": (0, None), "response_format": ({"type": "text"}, None), "best_of": (1, None),
               "suffix": ("", None), "audio": (None,), "prediction": (None,)}


class _Common(SamplingExtras):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="Only one choice per request.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed for sampling, 0..2**64-1.")
    rag: RagOptions | None = None
    segments: list[str] | None = None
    mode: str | None = None
    seam: int | None = Field(None, ge=0)
    recompute: float | None = Field(None, ge=0.0, le=1.0, description="Query-aware recompute budget, as in /query.")
    exact: bool = False  # exact reuse only, as in /query
    cache: CacheOptions | None = None
    speculation: bool | None = Field(None, description="Speculative decoding with prompt-lookup drafts; null: the "
                                     "gateway's setting (HYPIC_SPECULATION).")
    prompt_cache_key: str | None = Field(None, max_length=1024, description="OpenAI's grouping hint; accepted, the cache "
                                         "stays the key's tenant's whatever it says.")
    top_k: int = Field(-1, ge=-1, description="Sample from the k most likely tokens; -1 or 0: all.")  # vLLM's

    @field_validator("mode")
    @classmethod
    def _mode_named(cls, value: str | None) -> str | None:
        return mode_named(value)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


@router.get("/models", response_model=schemas.ModelList, responses=schemas.errors(503))
async def models(request: Request) -> dict:
    rt: Runtime = request.app.state.runtime
    rt.require_ready()
    return {"object": "list", "data": [{"id": rt.model_name, "object": "model", "created": rt.created,
                                        "owned_by": "hypic", "max_model_len": rt.engine.max_positions}]}


@router.post("/chat/completions", response_model=schemas.ChatCompletion, response_model_exclude_unset=True,
             responses={200: {"content": schemas.CHAT_STREAM}} | schemas.errors(400, 404, 413, 429, 503))
async def chat_completions(body: ChatRequest, request: Request):
    started = time.perf_counter()
    rt = _accept(request, body)
    if body.top_logprobs and not body.logprobs:
        raise APIError.invalid("top_logprobs", "requires logprobs: true")
    pipeline.check_count("messages", body.messages, rt.settings.max_messages, "HYPIC_MAX_MESSAGES")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    _check_sizes(rt, body, [(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)])
    hits = await _retrieve(rt, body, messages[-1]["content"], tenant_of(request))
    asked = body.max_completion_tokens or body.max_tokens
    prompt = await pipeline.off_loop(lambda: rt.prompter.chat(messages, hits, body.segments or (),
                                                              reserve=asked or rt.settings.answer_reserve_tokens))
    gen = _generation(rt, body, prompt, asked or rt.settings.max_new_tokens, body.logprobs, body.top_logprobs or 0,
                      tenant_of(request))
    stream = pipeline.start(rt, gen, started, "/v1/chat/completions", tenant_of(request))
    reply = _Reply(rt, "chat.completion", body, chat=True, prompt=prompt)
    if body.stream:
        return sse.response(reply.stream(stream), rt.settings.sse_keepalive_s)
    return await reply.whole(stream, request)


@router.post("/completions", response_model=schemas.Completion, response_model_exclude_unset=True,
             responses={200: {"content": schemas.COMPLETION_STREAM}} | schemas.errors(400, 404, 413, 429, 503))
async def completions(body: CompletionRequest, request: Request):
    started = time.perf_counter()
    rt = _accept(request, body)
    if body.echo:
        raise APIError.invalid("echo", "echo is not supported")
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError.invalid("prompt", "exactly one prompt per request is supported")
        prompt = prompt[0]
    _check_sizes(rt, body, [("prompt" if isinstance(body.prompt, str) else "prompt[0]", prompt)])
    hits = await _retrieve(rt, body, prompt, tenant_of(request))
    built = await pipeline.off_loop(lambda: rt.prompter.completion(prompt, hits, body.segments or (),
                                                                   reserve=body.max_tokens or rt.settings.answer_reserve_tokens))
    want = body.logprobs is not None
    gen = _generation(rt, body, built, body.max_tokens or rt.settings.max_new_tokens, want, body.logprobs or 0,
                      tenant_of(request))
    stream = pipeline.start(rt, gen, started, "/v1/completions", tenant_of(request))
    reply = _Reply(rt, "text_completion", body, chat=False, prompt=built)
    if body.stream:
        return sse.response(reply.stream(stream), rt.settings.sse_keepalive_s)
    return await reply.whole(stream, request)


def _accept(request: Request, body: _Common) -> Runtime:
    """The runtime, if `body` asks for nothing unsupported, the runtime is ready, serves
    `body.model` and has room for one more request."""
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
            raise APIError.invalid(name, f"is not supported by this server (got {shown(value)})")
    rt: Runtime = request.app.state.runtime
    rt.require_ready()
    if body.model != rt.model_name:
        raise APIError(404, f"model: {shown(body.model)} does not exist; this server serves {rt.model_name!r}",
                       param="model", code="model_not_found")
    pipeline.require_room(rt)
    return rt


def _check_sizes(rt: Runtime, body: _Common, texts: list[tuple[str, str]]) -> None:
    """400 naming the field for too many segments or stop strings, or too much text to tokenize
    (`texts`, then the segments); checked before anything is tokenized."""
    pipeline.check_count("segments", body.segments, rt.settings.max_segments, "HYPIC_MAX_SEGMENTS")
    pipeline.check_stops(rt, body.stops())
    pipeline.check_text(rt, texts + [(f"segments[{i}]", s) for i, s in enumerate(body.segments or ())])


async def _retrieve(rt: Runtime, body: _Common, query: str, tenant: str) -> list:
    """Retrieved chunks for `query` from `tenant`'s collections when `rag` is given, else none."""
    if body.rag is None:
        return []
    found = await pipeline.retrieve(rt, query, body.rag.top_k or rt.settings.default_top_k, body.rag.document_ids, "rag.",
                                    tenant=tenant, collections=body.rag.collections)
    return found.hits


def _generation(rt: Runtime, body: _Common, prompt: Prompt, max_tokens: int, logprobs: bool, top_logprobs: int, tenant: str):
    # Messages and segments are the tenant's own text: always the tenant's salt.
    return pipeline.generation_request(rt, prompt.segments, body.mode, body.seam, body.exact, prompt.exact_prefix,
                                       cache_salt=cache_salt(tenant), cache_store=body.cache is None or body.cache.store,
                                       speculation=body.speculation, recompute=body.recompute, max_tokens=max_tokens,
                                       temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                       stop=body.stops(), logprobs=logprobs, top_logprobs=top_logprobs,
                                       top_k=max(body.top_k, 0), **body.extras())


class _Reply:
    """Builds one response (whole or as chunks) in the OpenAI shape of `object`."""

    def __init__(self, rt: Runtime, object: str, body: _Common, chat: bool, prompt: Prompt) -> None:
        self.rt = rt
        self.sources = pipeline.sources(prompt) if body.rag is not None else {}
        self.object = object
        self.chat = chat
        self.want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # completions text_offset of the next token

    async def whole(self, stream: TokenStream, request: Request) -> dict:
        events = await collect(stream, request)
        text = "".join(e.text for e in events)
        choice = {"index": 0, "finish_reason": events[-1].finish_reason, "logprobs": self._logprobs(events)}
        choice |= {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.rt.model_name,
                "choices": [choice], "usage": _usage(stream)} | self.sources

    async def stream(self, stream: TokenStream):
        try:
            if self.chat:
                yield self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
                                  self.sources)
            elif self.sources:
                yield self._chunk(self._content("") | {"logprobs": None, "finish_reason": None}, self.sources)
            async for batch in stream.batches():
                text = "".join(e.text for e in batch)
                logprobs = self._logprobs(batch)
                if text or logprobs:
                    yield self._chunk(self._content(text) | {"logprobs": logprobs, "finish_reason": None})
                if batch[-1].finish_reason is not None:
                    yield self._chunk(self._content("", end=True) | {"logprobs": None, "finish_reason": batch[-1].finish_reason})
            if self.include_usage:
                yield sse.event(None, self._envelope([]) | {"usage": _usage(stream)})
        except Exception as exc:
            error = from_stream_failure(exc)
            log.warning("stream failed", extra={"error": repr(exc)})
            yield sse.event(None, error.body())
        yield sse.event(None, "[DONE]")

    def _content(self, text: str, end: bool = False) -> dict:
        if self.chat:
            return {"delta": {} if end else {"content": text}}
        return {"text": text}

    def _chunk(self, choice: dict, extra: dict | None = None) -> str:
        out = self._envelope([{"index": 0} | choice]) | (extra or {})
        if self.include_usage:
            out["usage"] = None
        return sse.event(None, out)

    def _envelope(self, choices: list) -> dict:
        kind = f"{self.object}.chunk" if self.chat else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.rt.model_name, "choices": choices}

    def _logprobs(self, events: list[StepOutput]) -> dict | None:
        """OpenAI logprobs of the generated tokens in `events` (EOS excluded), or None if not asked."""
        if not self.want_logprobs:
            return None
        eos = self.rt.engine.eos_ids
        tokens = [e for e in events if e.token_id is not None and e.token_id not in eos]
        if self.chat:
            return {"content": [self._chat_token(e) for e in tokens]} if tokens else None
        if not tokens:
            return None
        texts = [self._token_text(e.token_id) for e in tokens]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in tokens],
                "top_logprobs": [{self._token_text(t): lp for t, lp in e.top_logprobs} for e in tokens],
                "text_offset": offsets}

    def _chat_token(self, event: StepOutput) -> dict:
        return self._token_entry(event.token_id, event.logprob) | {
            "top_logprobs": [self._token_entry(t, lp) for t, lp in event.top_logprobs]}

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self._token_text(token_id), "logprob": logprob, "bytes": self.rt.tokens.bytes(token_id)}

    def _token_text(self, token_id: int) -> str:
        return self.rt.tokens.text(token_id)


def _usage(stream: TokenStream) -> dict:
    u = pipeline.usage(stream)
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"], "composed_tokens": u["composed_tokens"],
                                      "seam_tokens": u["seam_tokens"]}}
