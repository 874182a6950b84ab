"""Link tokens: the third rung of the reuse-training ladder (`hypic tune --link`).

A model served with a link (app/service/prompter.py, `PromptLayout.link`) gets a few special
tokens after every document, as a segment of their own. A document's cache entry is computed
alone; its link is shorter than the seam, so the stitch recomputes it in every request on top of
everything before it, the documents before it and its own. Trained, the link tokens' embeddings
learn to carry what crosses a document boundary to the text after it (KVLink's link tokens), at a
cost of a few recomputed tokens per document.

`LinkRows` makes the rows of those tokens in the input embedding trainable and nothing else of
it: the whole table is the trained parameter (so a tied output head sees the same rows, as the
merged model will), and a gradient hook zeroes every other row's gradient (with no weight decay,
AdamW then leaves them exactly as they were). What is saved and shipped is the rows' change,
`<table>.row_delta` with their ids `<table>.row_ids`, which hypic_core/models/loader.py adds on
load: the model keeps its layout (the vocabulary is unchanged; the tokens were unused specials).

`Tunings` puts it beside LoRA or full fine-tuning behind the one interface the trainer uses.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from hypic_core.models.loader import ROW_DELTA, ROW_IDS


def link_ids(tokenizer, link: str) -> tuple[int, ...]:
    """The token ids of the link text `link`, each an added special token that the chat template
    and the tokenizer's own roles (BOS, EOS, padding) do not use. Raises ValueError otherwise:
    training any other token's row would change how ordinary text reads."""
    specials = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    ids = tokenizer.encode(link, add_special_tokens=False) if link else []  # special tokens parsed, as in trusted text
    text = [i for i in ids if i not in specials]
    if text:
        raise ValueError(f"link {link!r}: {tokenizer.decode(text)!r} is not a special token of this tokenizer; a link is written as "
                         f"special tokens only (unused ones, e.g. {', '.join(unused_specials(tokenizer)[:4]) or 'none'})")
    if not ids:
        raise ValueError("link must name at least one special token")
    used = set(roles(tokenizer))
    taken = [tokenizer.convert_ids_to_tokens(i) for i in ids if i in used]
    if taken:
        raise ValueError(f"link {link!r}: {taken[0]} is used by the tokenizer or its chat template; "
                         f"unused special tokens: {', '.join(unused_specials(tokenizer)) or 'none'}")
    return tuple(ids)


def roles(tokenizer) -> set[int]:
    """Ids the tokenizer gives a role: BOS, EOS, padding, unknown (each named token), and every special
    token its chat template writes."""
    named = (getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "pad", "unk", "sep", "cls", "mask"))
    out = {int(i) for i in named if isinstance(i, int)}
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "v"}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        specials = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        out |= {int(i) for i in ids if int(i) in specials}
    return out


def unused_specials(tokenizer) -> list[str]:
    """The added special tokens without a role (`roles`): what a link may be written with."""
    used = roles(tokenizer)
    return [t.content for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items()) if t.special and i not in used]


class LinkRows:
    """The input-embedding rows of `ids` trainable in `model` (mutates it: the table's
    requires_grad, a gradient hook); their original values kept, from which the change is taken."""

    def __init__(self, model: nn.Module, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("LinkRows needs at least one token id")
        self.weight = model.get_input_embeddings().weight
        self.name = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is self.weight)
        if not 0 <= min(ids) <= max(ids) < self.weight.shape[0]:
            raise ValueError(f"link ids {sorted(ids)} outside the embedding's {self.weight.shape[0]} rows")
        self.ids = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long)
        self.original = self.weight.detach()[self.ids].clone()
        mask = torch.zeros(self.weight.shape[0], 1, dtype=self.weight.dtype)
        mask[self.ids] = 1
        self.weight.requires_grad_(True)
        self._hook = self.weight.register_hook(lambda grad: grad * mask.to(grad.device, grad.dtype))

    def parameters(self) -> list[nn.Parameter]:
        return [self.weight]

    def rows(self) -> torch.Tensor:
        return self.weight.detach()[self.ids]

    def state(self) -> dict[str, torch.Tensor]:
        """`{"<table>.row_delta": tuned rows - original, "<table>.row_ids": their ids}`."""
        return {f"{self.name}{ROW_DELTA}": self.rows() - self.original, f"{self.name}{ROW_IDS}": self.ids.clone()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the rows to original + the state's change; a state without rows (an adapter trained
        before the link was added) leaves them as they are. Raises ValueError for other rows."""
        delta, ids = state.get(f"{self.name}{ROW_DELTA}"), state.get(f"{self.name}{ROW_IDS}")
        if delta is None and ids is None:
            return
        if delta is None or ids is None or not torch.equal(ids.long(), self.ids) or delta.shape != self.original.shape:
            raise ValueError(f"link rows: the state holds rows {None if ids is None else ids.tolist()}, "
                             f"this run trains {self.ids.tolist()}")
        with torch.no_grad():
            self.weight[self.ids] = self.original + delta.to(self.weight.dtype)

    def exported(self) -> dict[str, torch.Tensor]:
        state = self.state()
        return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}

    @contextlib.contextmanager
    def disabled(self):
        """The original rows inside it, the trained ones restored on exit."""
        saved = self.rows().clone()
        with torch.no_grad():
            self.weight[self.ids] = self.original
        try:
            yield self
        finally:
            with torch.no_grad():
                self.weight[self.ids] = saved


class Tunings:
    """Several tunings of one model (LoRA or full fine-tuning, and link rows) as one, for the trainer."""

    def __init__(self, *parts) -> None:
        self.parts = parts

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v for part in self.parts for k, v in part.state().items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for part in self.parts:
            part.load_state(state)

    def exported(self) -> dict[str, torch.Tensor]:
        return {k: v for part in self.parts for k, v in part.exported().items()}

    @contextlib.contextmanager
    def disabled(self):
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.disabled())
            yield self
