"""Turn requests into token-id segments: [system prefix, one per document, question].

Each document is its own segment, tokenized alone, so the same document always gives the same
token ids (and the same cache entry) wherever it lands in a later prompt. A segment's end is
tokenized as if the next document followed it (`SafeEncoder.encode(..., followed_by)`), so the
segments join as the whole prompt text is tokenized wherever the tokenizer allows it. Chunks are ordered by
ascending score, so the best match sits next to the question.

Two prompt formats (`PromptLayout.format`):

- `chat`: the tokenizer's chat template. The system prompt is the system message; documents go
  into the last user turn, before its content:

      s_0.. = one segment per earlier message (template text and content: the system prompt,
              earlier turns), then the template text before the last user message's content;
              these are the exact prefix: reused exactly from an exact snapshot, never composed
      s_i = document i (`document_template`)
      q   = the last user content (a /query question through `question_template`), everything
            the template puts after it (the generation prompt), then `answer_prefix`

- `raw`, for models without a chat template: `system_prompt`, each document through
  `document_template`, the question through `question_template`, then `answer_prefix`, used
  exactly as given: nothing is added around or between them.

Link segments (`PromptLayout.link`, a model trained with them says so in its checkpoint): a few
special tokens written after every document as a segment of their own. A document's segment is
computed alone and reused; its link is short enough to lie inside the seam, so it is recomputed in
every request on top of everything before it (the documents before it and its own): trained
embeddings that carry what crosses a document boundary to what follows (KVLink's link tokens).

Safe tokenization: text that comes from users (questions, messages, documents) is tokenized with
special-token parsing off, so a document containing `<|im_end|>` cannot close a turn or forge
one. Only the special tokens written by the template and the settings are special.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Literal, Sequence

from hypic_core.errors import InvalidRequestError
from retrieval.index import SearchHit


Part = tuple[str, bool]  # (text, trusted): trusted text may contain special tokens
Tokens = tuple[int, ...]

_FORMATTER = string.Formatter()
_MARK = "\u2063HYPIC{}\u2063"
_MARK_RE = re.compile("\u2063HYPIC(\\d+)\u2063")


@dataclass(frozen=True)
class PromptLayout:
    """How segments are written (see the module docstring)."""

    format: Literal["chat", "raw"]
    system_prompt: str
    document_template: str  # fields: {text}, {title}
    question_template: str  # field: {question}
    answer_prefix: str = ""
    link: str = ""  # trusted text (special tokens) written after every document as its own segment


# What a model gets when neither its named entry nor the settings say otherwise.
GENERIC = {
    "chat": PromptLayout("chat", "Answer the question using the documents.", "{text}\n\n", "{question}"),
    "raw": PromptLayout("raw", "Answer the question using the documents.\n\n", "Document: {text}\n\n",
                        "Question: {question}\n", "Answer:"),
}


def check_template(template: str, allowed: set[str], required: str) -> str:
    """Raise ValueError unless `template` is a format string using only `allowed` fields and `required`."""
    try:
        fields = {name for _, name, _, _ in _FORMATTER.parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"not a valid template: {exc}") from None
    unknown = fields - allowed
    if unknown:
        raise ValueError(f"unknown field {{{sorted(unknown)[0]}}}; allowed: {', '.join('{' + a + '}' for a in sorted(allowed))}")
    if required not in fields:
        raise ValueError(f"must contain {{{required}}}")
    try:  # a conversion or format spec that fails for "" fails for every string (`{text:d}`, `{text!x}`)
        fill(template, **dict.fromkeys(fields, ""))
    except ValueError as exc:
        raise ValueError(f"not a valid template: {exc}") from None
    return template


def fill(template: str, **values: str) -> list[Part]:
    """`template` formatted with `values`: its literal text trusted, the values not."""
    parts: list[Part] = []
    for literal, name, spec, conversion in _FORMATTER.parse(template):
        if literal:
            parts.append((literal, True))
        if name is not None:
            value = _FORMATTER.convert_field(values[name], conversion)
            parts.append((_FORMATTER.format_field(value, spec or ""), False))
    return parts


class SafeEncoder:
    """Token ids of text parts; special tokens are recognised in trusted parts only."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        specials = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self._special_ids = specials
        names = sorted(specials, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, names))) if names else None

    def encode(self, parts: Sequence[Part], followed_by: str | None = None) -> Tokens:
        """The ids of `parts`, their text ending as it is tokenized when `followed_by` (trusted
        text: what comes next in the prompt) follows it; None: at the end of the text.

        A byte-level BPE splits a run of whitespace by what follows it (`"a.\n\n"` alone ends in
        one `\n\n` token, followed by `Document` in two `\n`), so the text is tokenized with the
        first word of `followed_by` after it and that word's ids are cut off again, when they come
        out as that word alone does; otherwise (the word merged with the end: `"a. "` +
        `Document` is ` Document`) the text is tokenized alone. Either way the ids spell exactly
        the text of `parts` and depend on `followed_by` only through its first word."""
        ids: list[int] = []
        run: list[str] = []
        probe = self._probe(followed_by)

        def flush(last: bool = False) -> None:
            text = "".join(run)
            run.clear()
            if text and last and probe:
                ids.extend(self._before(text, probe))
            elif text:
                ids.extend(self._plain(text))

        for text, trusted in parts:
            if not trusted or self._pattern is None:
                run.append(text)
                continue
            pos = 0
            for match in self._pattern.finditer(text):
                run.append(text[pos:match.start()])
                flush()
                ids.append(self._special_ids[match.group()])
                pos = match.end()
            run.append(text[pos:])
        flush(last=True)
        return tuple(ids)

    def _plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def _probe(self, followed_by: str | None) -> str:
        """What stands for `followed_by` at a join: its leading whitespace and first word (up to
        16 characters, stopping at a special token, after which the text ends as at its end)."""
        if not followed_by:
            return ""
        word = re.match(r"\s*\S{0,16}", followed_by).group()
        if self._pattern is not None:
            special = self._pattern.search(word)
            word = word[: special.start()] if special else word
        return word

    def _before(self, text: str, probe: str) -> list[int]:
        together, alone = self._plain(text + probe), self._plain(probe)
        head = together[: len(together) - len(alone)]
        # The cut-off ids are the word's own and spell exactly it, so `head` spells exactly `text`.
        if head and together[len(head):] == alone and self.tokenizer.decode(alone, clean_up_tokenization_spaces=False) == probe:
            return head
        return self._plain(text)

    def text(self, text: str) -> Tokens:
        """Untrusted text alone."""
        return self.encode([(text, False)])


@dataclass(frozen=True)
class Prompt:
    """Segments of one request and the retrieved chunks they hold (best first)."""

    segments: list[Tokens]
    used: list[SearchHit]
    dropped: int  # retrieved chunks left out because they did not fit the context
    exact_prefix: int = 0  # leading segments (system prompt, earlier turns) to reuse exactly, never by composition
    places: tuple[int, ...] = ()  # the index in `segments` of each `used` chunk

    @property
    def tokens(self) -> int:
        return sum(map(len, self.segments))


class Prompter:
    """Builds `Prompt`s for /query, chat and completions; fits retrieved chunks to `context`."""

    def __init__(self, tokenizer, layout: PromptLayout, context: int) -> None:
        self.layout = layout
        self.context = context
        self.encoder = SafeEncoder(tokenizer)
        # What follows a segment before the question: the next document, as the template writes it.
        self._next = "".join(text for text, _ in fill(layout.document_template, text="Document", title="Document"))
        # The link segment written after every document, where the layout has one. Documents are
        # tokenized as without it (as followed by the next document), so leaving the links out of a
        # prompt gives exactly the prompt of the same layout without a link.
        self.link: Tokens = self.encoder.encode([(layout.link, True)]) if layout.link else ()
        if layout.format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompt format 'chat' needs a tokenizer with a chat template; use the raw format")

    # --- endpoints -------------------------------------------------------------------------
    def query(self, question: str, hits: Sequence[SearchHit], reserve: int) -> Prompt:
        """A /query question answered from `hits`, keeping `reserve` tokens of context for the answer."""
        content = fill(self.layout.question_template, question=question)
        head, tail = self._frame([{"role": "user", "content": content}], "question")
        return self._fit(head, [], hits, tail, reserve, "question")

    def chat(self, messages: Sequence[dict], hits: Sequence[SearchHit], segments: Sequence[str], reserve: int) -> Prompt:
        """A conversation; `segments` (kept) and retrieved `hits` (fitted) go before the last user
        message's content. Raises `InvalidRequestError` naming `messages` unless the last message is the user's."""
        if not messages or messages[-1].get("role") != "user":
            raise InvalidRequestError("messages", "the last message must be the user's")
        convo = [{"role": m["role"], "content": [(str(m["content"]), False)]} for m in messages]
        if self.layout.format == "raw":
            if any(m["role"] == "assistant" for m in messages) or sum(m["role"] == "user" for m in messages) > 1:
                raise InvalidRequestError("messages", "this model has no chat template: send one user message (and an optional "
                                                      "system message), or use /v1/completions")
            convo[-1]["content"] = fill(self.layout.question_template, question=str(messages[-1]["content"]))
        head, tail = self._frame(convo, "messages")
        kept = [self.encoder.encode([(s.rstrip() + "\n", False)], self._next) for s in segments]
        return self._fit(head, kept, hits, tail, reserve, "messages")

    def completion(self, prompt: str, hits: Sequence[SearchHit], segments: Sequence[str], reserve: int) -> Prompt:
        """A raw completion: each segment as given, retrieved chunks through `document_template`,
        then the prompt; no chat template, no system prompt."""
        question = self.encoder.text(prompt)
        if not question:
            raise InvalidRequestError("prompt", "must not be empty")
        kept = [ids for ids in (self.encoder.encode([(s, False)], self._next) for s in segments) if ids]
        return self._fit([], kept, hits, [question], reserve, "prompt")

    def document(self, text: str, title: str = "") -> Tokens:
        """The segment of one document, as retrieved chunks are written."""
        return self.encoder.encode(fill(self.layout.document_template, text=text.strip(), title=title), self._next)

    # --- internals -------------------------------------------------------------------------
    def _frame(self, messages: list[dict], field: str) -> tuple[list[Tokens], list[Tokens]]:
        """(segments before the documents, segments after them) for `messages`, whose contents are
        lists of parts; the documents go before the last message's content."""
        layout = self.layout
        if layout.format == "raw":
            system = ["".join(text for text, _ in m["content"]) for m in messages if m["role"] in ("system", "developer")]
            head = self.encoder.encode([(system[-1], False)] if system else [(layout.system_prompt, True)], self._next)
            tail = self.encoder.encode([*messages[-1]["content"], (layout.answer_prefix, True)])
            return [head] if head else [], [tail]
        if not any(m["role"] == "system" for m in messages) and layout.system_prompt:
            messages = [{"role": "system", "content": [(layout.system_prompt, True)]}, *messages]
        contents = [m["content"] for m in messages]
        marked = [{"role": m["role"], "content": _MARK.format(i)} for i, m in enumerate(messages)]
        rendered = self.encoder.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
        pieces = _MARK_RE.split(rendered)  # literal, index, literal, index, ..., literal
        if len(pieces) != 2 * len(messages) + 1:
            raise InvalidRequestError(field, "the chat template did not render every message")
        # One head segment per earlier message (its template text and content), then the template
        # text before the last message: turn n's head is a prefix, segment for segment, of turn n+1's.
        groups: list[list[Part]] = []
        current: list[Part] = []
        tail: list[Part] | None = None
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if piece:
                    (current if tail is None else tail).append((piece, True))
            elif int(piece) == len(messages) - 1:
                groups.append(current)
                tail = list(contents[int(piece)])
            else:
                groups.append([*current, *contents[int(piece)]])
                current = []
        # Each group ends as the text after it begins: the next group's template text, else a document.
        follows = [next((text for text, _ in later if text), None) for later in groups[1:]] + [self._next]
        head = [ids for ids in (self.encoder.encode(g, f or self._next) for g, f in zip(groups, follows)) if ids]
        return head, [self.encoder.encode([*(tail or []), (layout.answer_prefix, True)])]

    def _fit(self, head: list[Tokens], kept: list[Tokens], hits: Sequence[SearchHit], tail: list[Tokens],
             reserve: int, field: str) -> Prompt:
        """`head`, `kept`, the retrieved documents that fit and `tail`: documents are added best
        first until the next one would leave less than `reserve` tokens of context for the answer
        (the rest are dropped, and never tokenized). Every document (kept or retrieved) is followed
        by the layout's link segment, when it has one. A prompt that does not fit even without
        documents is an `InvalidRequestError`."""
        link = len(self.link)
        fixed = sum(map(len, head + kept + tail)) + link * len(kept)
        if fixed >= self.context:
            raise InvalidRequestError(field, f"the prompt is {fixed} tokens without any retrieved chunk; the model's context is "
                                             f"{self.context} tokens: shorten the {field}" + (" or the segments" if kept else ""))
        room = self.context - reserve - fixed
        used: list[tuple[SearchHit, Tokens]] = []
        for hit in sorted(hits, key=lambda h: h.score, reverse=True):
            ids = self.document(hit.chunk.text, hit.chunk.title)
            if len(ids) + link > room:
                break
            used.append((hit, ids))
            room -= len(ids) + link
        order = sorted(range(len(used)), key=lambda i: used[i][0].score)  # worst first: the best sits next to the question
        linked = (lambda ids: (ids, self.link)) if link else (lambda ids: (ids,))  # a document, then its link
        before = [s for s in head if s] + [s for ids in kept if ids for s in linked(ids)]
        places = [0] * len(used)
        for rank, i in enumerate(order):
            places[i] = len(before) + (2 if link else 1) * rank
        documents = [s for i in order for s in linked(used[i][1])]
        segments = before + documents + [s for s in tail if s]
        return Prompt(segments, [h for h, _ in used], len(hits) - len(used), min(len(head), len(segments) - 1), tuple(places))
