"""Admission and per-request limits: what runs at once, what waits, and how large a request may be."""

from __future__ import annotations

from pydantic import Field

from .base import AreaSettings


class LimitSettings(AreaSettings):
    """Admission (running, queued) and the size limits of one request."""

    max_new_tokens: int = Field(1024, ge=1, description="Upper bound on max_tokens of any request.")
    max_running: int = Field(8, ge=1, description="Generations prefilling or decoding at once; running ones advance in one batched forward per step.")
    max_step_tokens: int = Field(512, ge=1, description="Model tokens per engine step (decode tokens + a chunk of prefill): "
                                 "a long prompt is prefilled over several steps so running streams keep producing tokens.")
    running_budget_bytes: int = Field(4 << 30, ge=1, description="Attention K/V + linear state the running generations may hold; "
                                      "a request that does not fit waits.")
    max_queue: int = Field(16, ge=0, description="Admitted requests waiting for a running slot; beyond this: 429.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 and with 503 while loading.")
    max_body_bytes: int = Field(8 << 20, ge=1, description="Bytes of one request body; beyond: 413.")
    # Checked before anything is tokenized (on a thread): text costs ~0.6 s per MB to tokenize.
    max_text_bytes: int = Field(1 << 20, ge=1, description="UTF-8 bytes of text one request asks to tokenize: the question "
                                "or prompt, message contents and segments together (a /search query alone); beyond: 400 "
                                "naming the field where the total passes it, before anything is tokenized.")
    max_messages: int = Field(1024, ge=1, description="Messages in one chat request; beyond: 400 naming messages.")
    max_segments: int = Field(256, ge=1, description="Entries of `segments` in one request; beyond: 400 naming segments.")
    max_document_ids: int = Field(1024, ge=1, description="Entries of `document_ids` in one request; beyond: 400 naming "
                                  "document_ids (500,000 of them took 2.7 s of retrieval).")
    max_stop_strings: int = Field(16, ge=0, description="Stop strings in one request; beyond: 400 naming stop.")
    max_stop_bytes: int = Field(1024, ge=0, description="UTF-8 bytes of a request's stop strings together; beyond: 400 naming stop.")
