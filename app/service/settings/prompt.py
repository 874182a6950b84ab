"""How the prompt is laid out (app/service/prompter.py): unset, the named model's own layout, else the generic one for the format."""

from __future__ import annotations

from pydantic import Field, field_validator
from typing import Literal

from .base import AreaSettings


class PromptSettings(AreaSettings):
    """The prompt's layout and the room kept for the answer."""

    prompt_format: Literal["auto", "chat", "raw"] = Field("auto", description="chat: the tokenizer's chat template; raw: the "
                                                          "templates below as given; auto: chat when the tokenizer has a template.")
    system_prompt: str | None = Field(None, description="System message (chat) or the text the prompt starts with (raw).")
    document_template: str | None = Field(None, description="How a retrieved chunk is written into the prompt ({text}, {title}).")
    question_template: str | None = Field(None, description="How a /query question is written into the prompt ({question}).")
    answer_prefix: str | None = Field(None, description="Text after the question (raw) or after the generation prompt (chat).")
    link: str | None = Field(None, description="Special tokens written after every document as a segment of their own, "
                             "recomputed in every request (a model trained with them, hypic tune --link, says so itself).")
    answer_reserve_tokens: int = Field(256, ge=1, description="Context kept for the answer when fitting retrieved chunks to a "
                                       "request without max_tokens.")

    @field_validator("document_template")
    @classmethod
    def _document_template(cls, value: str | None) -> str | None:
        from ..prompter import check_template

        return None if value is None else check_template(value, {"text", "title"}, "text")

    @field_validator("question_template")
    @classmethod
    def _question_template(cls, value: str | None) -> str | None:
        from ..prompter import check_template

        return None if value is None else check_template(value, {"question"}, "question")


    def prompt_layout(self, tokenizer, known_prompt: dict[str, str] | None = None):
        """The prompt layout: these settings where set, else the named model's, else the generic one."""
        from ..prompter import GENERIC, PromptLayout

        fmt = self.prompt_format
        if fmt == "auto":
            fmt = "chat" if getattr(tokenizer, "chat_template", None) else "raw"
        base = GENERIC[fmt].__dict__ | (known_prompt or {})
        chosen = {name: getattr(self, name) for name in ("system_prompt", "document_template", "question_template", "answer_prefix", "link")}
        return PromptLayout(**(base | {k: v for k, v in chosen.items() if v is not None} | {"format": fmt}))
