"""Turn a conversation plus retrieved documents into token-id segments.

Segments are tokenized separately, so the same document always gives the same token ids
(and the same cache entry) wherever it lands:

    s_0  = everything the chat template puts before the last user message's content
    s_i  = document i, followed by a blank line
    q    = the last user message's content and everything after it (generation prompt)
"""

from __future__ import annotations

from typing import Sequence

DEFAULT_SYSTEM_PROMPT = "Answer the question using the documents."
_MARK = "\u2063HYPIC_DOCUMENTS\u2063"


class PromptBuilder:
    def __init__(self, tokenizer, system_prompt: str = DEFAULT_SYSTEM_PROMPT, separator: str = "\n\n"):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.separator = separator

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def texts(self, messages: Sequence[dict], documents: Sequence[str] = ()) -> list[str]:
        """Segment texts: [prefix, *documents, question]. `messages` are {"role", "content"} dicts."""
        messages = [dict(m) for m in messages]
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("messages must end with a user message")
        if not any(m.get("role") == "system" for m in messages) and self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        last = messages[-1]
        if self.has_chat_template:
            last["content"] = _MARK + str(last["content"])
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prefix, question = rendered.split(_MARK, 1)
        else:
            head = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1])
            prefix, question = head + self.separator, f"Question: {last['content']}\nAnswer:"
        return [prefix, *(d.rstrip() + self.separator for d in documents), question]

    def segments(self, messages: Sequence[dict], documents: Sequence[str] = ()) -> list[tuple[int, ...]]:
        return [self.encode(t) for t in self.texts(messages, documents) if t]
