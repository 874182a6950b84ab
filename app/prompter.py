"""Turn requests into token-id segments: [system prefix, one per document, question].

Each document is its own segment, so its cache entry is reused wherever it lands in a later
prompt. Retrieved chunks are written with `settings.document_template` and /query questions
with `settings.question_template` (defaults: the layout the bundled model was trained on).
Chunks are ordered by ascending score, so the best match sits next to the question.
"""

from __future__ import annotations

from typing import Sequence

from hypic_core.prompt import PromptBuilder
from retrieval.index import SearchHit

from .errors import APIError
from .settings import Settings


class Prompter:
    def __init__(self, tokenizer, settings: Settings) -> None:
        self.builder = PromptBuilder(tokenizer, settings.system_prompt, separator="\n")
        self.document_template = settings.document_template
        self.question_template = settings.question_template

    def documents(self, hits: Sequence[SearchHit]) -> list[str]:
        """Document texts for retrieved chunks, worst match first."""
        ordered = sorted(hits, key=lambda h: h.score)
        return [self.document_template.format(text=h.chunk.text, title=h.chunk.title) for h in ordered]

    def question(self, question: str, documents: Sequence[str]) -> list[tuple[int, ...]]:
        """Segments for a /query question answered from `documents`."""
        return self.builder.segments([{"role": "user", "content": self.question_template.format(question=question)}], documents)

    def chat(self, messages: Sequence[dict], documents: Sequence[str]) -> list[tuple[int, ...]]:
        """Segments for a chat: `documents` go between the conversation and the last user message.
        Raises a 400 naming `messages` unless the last message is the user's."""
        try:
            return self.builder.segments(messages, documents)
        except ValueError as exc:
            raise APIError.invalid("messages", str(exc)) from None

    def completion(self, prompt: str, documents: Sequence[str]) -> list[tuple[int, ...]]:
        """Segments for a raw completion: each document text as given, then the prompt; no template."""
        question = self.builder.encode(prompt)
        if not question:
            raise APIError.invalid("prompt", "must not be empty")
        return [ids for ids in map(self.builder.encode, documents) if ids] + [question]
