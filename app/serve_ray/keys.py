"""Routing keys of a gateway request: the chunks its prompt will hold, named before it is served.

    keys = routing_keys("POST", "/v1/completions", b"", body_bytes, search)   # -> ("text:9f2c...", ...)

- `segments: [text, ...]` (OpenAI endpoints): "text:" + a hash of each text.
- Retrieved chunks (`/query`, GET or POST; `rag` on the OpenAI endpoints): "chunk:" + chunk id of
  each hit of `search(query, top_k, document_ids)`, the search the replica will run itself (the
  index is shared and deterministic, so both find the same chunks while it does not change).
- `prompt_cache_key` (OpenAI endpoints): "hint:" + a hash of it, so requests a client groups under
  one key tend to one replica.
- Tenants (app/service/tenants.py): the ingress searches the default tenant's default collection
  only; a request of another tenant (`search` None: the ingress knows the tenant from the key) or
  one naming `collections` gets no retrieved-chunk keys. Routing only places a request: a
  replica's cache is salted by tenant whatever the route.
- Anything else (other paths, a body that is not a JSON object, fields of the wrong type, a
  failed search): no keys for that part. A request the gateway will refuse routes like any
  other; the replica gives the error. Never raises.

The configured system prompt is in no request body, so it is no key; a segment every request
gives (a shared preamble) becomes a key every replica soon holds, which biases nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Callable, Sequence
from urllib.parse import parse_qs

log = logging.getLogger("hypic.serve_ray")

Search = Callable[[str, int, "Sequence[str] | None"], Sequence[str]]
"""search(query, top_k, document_ids) -> chunk ids, best first."""


def text_key(text: str) -> str:
    return "text:" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def chunk_key(chunk_id: str) -> str:
    return "chunk:" + chunk_id


def hint_key(prompt_cache_key: str) -> str:
    return "hint:" + hashlib.blake2b(prompt_cache_key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def tenant_of_headers(headers: Sequence[tuple[bytes, bytes]], tenants: dict[bytes, str]) -> str | None:
    """The tenant the request's bearer key opens: `tenants` maps sha256 digests of keys to tenants
    (empty: no keys, the tenant 'default'); None for a missing or unknown key (the replica answers 401)."""
    if not tenants:
        return "default"
    given = [v for k, v in headers if k.lower() == b"authorization"]
    scheme, _, token = (given[0] if len(given) == 1 else b"").strip().partition(b" ")
    return tenants.get(hashlib.sha256(token.strip()).digest()) if scheme.lower() == b"bearer" else None


def routing_keys(method: str, path: str, query_string: bytes, body: bytes, search: Search | None,
                 default_top_k: int = 4) -> tuple[str, ...]:
    """The keys of one request (module docstring), in prompt order, without repeats."""
    path = "/" + path.strip("/")
    if method == "GET" and path == "/query":
        params = parse_qs(query_string.decode("latin-1"))
        if params.get("collections"):
            return ()
        question = (params.get("question") or [""])[-1]
        return _retrieved(search, question, _int((params.get("top_k") or [None])[-1]) or default_top_k,
                          params.get("document_ids"))
    if method != "POST" or path not in ("/query", "/v1/completions", "/v1/chat/completions"):
        return ()
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return ()
    if not isinstance(payload, dict):
        return ()
    if path == "/query":
        if payload.get("collections") is not None:
            return ()
        return _retrieved(search, payload.get("question"), _int(payload.get("top_k")) or default_top_k,
                          payload.get("document_ids"))
    keys: list[str] = []
    rag = payload.get("rag")
    if isinstance(rag, dict) and rag.get("collections") is None:
        keys += _retrieved(search, _query_text(path, payload), _int(rag.get("top_k")) or default_top_k, rag.get("document_ids"))
    segments = payload.get("segments")
    if isinstance(segments, list):
        keys += [text_key(s) for s in segments if isinstance(s, str)]
    hint = payload.get("prompt_cache_key")
    if isinstance(hint, str) and hint:
        keys.append(hint_key(hint))
    return tuple(dict.fromkeys(keys))


def _retrieved(search: Search | None, query, top_k: int, document_ids) -> tuple[str, ...]:
    if search is None or not isinstance(query, str) or not query.strip():
        return ()
    if document_ids is not None and not (isinstance(document_ids, list) and all(isinstance(d, str) for d in document_ids)):
        return ()
    try:
        return tuple(dict.fromkeys(chunk_key(c) for c in search(query, top_k, document_ids)))
    except Exception as exc:  # the replica runs the same search and reports the error properly
        log.debug("routing search failed", extra={"error": repr(exc)})
        return ()


def _query_text(path: str, payload: dict) -> str | None:
    """What the gateway retrieves with: the prompt (completions) or the last message (chat)."""
    if path == "/v1/completions":
        prompt = payload.get("prompt")
        return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    content = messages[-1].get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content


def _int(value) -> int | None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n > 0 and not isinstance(value, bool) else None
