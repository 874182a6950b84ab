"""What the generating routes (/query, the OpenAI endpoints) share on the HTTP side: the sampling
fields their bodies accept, and reading a whole generation for a JSON answer, aborting it when
the client disconnects."""

from __future__ import annotations

import asyncio

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from hypic_core.engine.sequence import StepOutput

from ..service.engine_thread import TokenStream


class SamplingExtras(BaseModel):
    """vLLM-compatible sampling fields every generating endpoint accepts (request-body mixin).

    Request bodies are validated strictly (`strict=True`, here and in every body model): a JSON
    scalar of the wrong type is a 400, not converted (`"max_tokens": true` is not 1, `"2"` is
    not 2, `0` is not false); an integer is still a valid number."""

    model_config = ConfigDict(strict=True)

    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False,
                         description="Drop tokens less likely than min_p times the most likely one.")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                                      description="Penalise tokens seen in the prompt or output; 1: off.")
    min_tokens: int = Field(0, ge=0, description="Tokens generated before EOS may end the output.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (until max_tokens or a stop string).")

    def extras(self) -> dict:
        """The fields as `SamplingParams` keyword arguments."""
        return {"min_p": self.min_p, "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
                "ignore_eos": self.ignore_eos}


class CacheOptions(BaseModel):
    """`cache` of a generating request: what the gateway may keep of it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    store: bool = Field(True, description="false: compute and answer, keep nothing (no cache entry, exact snapshot or "
                                          "shared-tier write); what is cached is still used.")


async def collect(stream: TokenStream, request: Request) -> list[StepOutput]:
    """Every event of `stream` (non-streaming responses). If the client disconnects first, the
    generation is aborted at once rather than run to the end for nobody. An error the engine
    reports for the request (`InvalidRequestError`) is raised here, for app/http/errors.py to map."""

    async def abort_on_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.abort.abort()

    watcher = asyncio.create_task(abort_on_disconnect())
    events: list[StepOutput] = []
    try:
        async for batch in stream.batches():
            events += batch
    finally:
        watcher.cancel()
    return events
