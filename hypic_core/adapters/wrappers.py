"""Kernel wrappers a patched forward installs in place of a modeling module's conv and scan ops.

Pure functions of what they wrap: each takes the original kernel (the torch fallback
`KernelSelection.fallback` names) and returns a function of the same signature that records into
a `Capture` or runs a fused stitch. The adapters decide *where* to install them
(`_capture_patches`, `_stitch_patches`); the arithmetic of a stitched span lives here, once for
every family.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import Capture, StitchSpan, span_chunk


def recording_conv(cap: Capture, conv_fn: Callable) -> Callable:
    """Wrap a conv function so every call's pre-conv input is appended to `cap.conv_inputs`."""

    def conv_wrapper(hidden_states, *args, **kwargs):
        cap.conv_inputs.append(cap.keep(hidden_states))
        return conv_fn(hidden_states, *args, **kwargs)

    return conv_wrapper


def stitch_conv(cap: Capture, spans: list[StitchSpan], conv_fn: Callable, conv_kernel: Callable[[int], int]) -> Callable:
    """A conv function for a fused stitch forward: each run span is convolved after the conv
    context of what precedes it (the previous span, then the cached body's conv tail shifted in),
    as a sequential stitch would. Records each layer's final context in `cap.conv_inputs`.

    The mixer passes [conv state | run tokens] (K + n_run columns); only the run tokens' outputs
    return. `conv_kernel(layer_pos)` is the layer's kernel width K.

    A span's context is made of inputs only (never of conv outputs), so every context is known
    before any convolution: the inputs a context can hold (the conv state, the run tokens, the bodies'
    conv tails) are put side by side once, and one gather lays the spans out as [context | span |
    context | span ...], each span after its own K columns, for ONE convolution (a depthwise causal
    conv of width K reads K - 1 columns back, never past its span's context); the spans' columns are
    then picked. The layout is plain index arithmetic, worked out once per stitch.
    """
    n_run = spans[-1].end if spans else 0
    layouts: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = {}

    def layout(K: int, n_ctx: int, lp: int):
        """(gather index into [conv state | run | tails | a zero column], output columns, final context
        index, tails' widths). A context shorter than K (the sequence's start) is padded with the zero
        column, as the conv's own padding would."""
        widths = [span.entry.conv_tails[lp].shape[-1] if span.entry is not None else 0 for span in spans]
        key = (K, n_ctx, *widths)
        if key not in layouts:
            hist = list(range(n_ctx))[-K:]  # source columns of the context, oldest first
            tail_at = n_ctx + n_run
            laid: list[int] = []
            keep: list[int] = []
            for span, width in zip(spans, widths):
                if span.end > span.start:
                    cols = list(range(n_ctx + span.start, n_ctx + span.end))
                    laid += [-1] * (K - len(hist)) + hist
                    keep += range(len(laid), len(laid) + len(cols))
                    laid += cols
                    hist = (hist + cols)[-K:]
                if width:
                    hist = (hist + list(range(tail_at, tail_at + width)))[-K:]
                    tail_at += width
            zero = tail_at
            laid = [zero if c < 0 else c for c in laid]
            laid_t, keep_t, hist_t = (torch.tensor(c, dtype=torch.long) for c in (laid, keep, hist))  # long even when empty
            layouts[key] = (laid_t, keep_t, hist_t, widths)
        return layouts[key]

    def conv_wrapper(hidden_states, *args, **kwargs):
        lp = len(cap.conv_inputs)
        K = conv_kernel(lp)
        n_ctx = min(K, hidden_states.shape[-1] - n_run)
        laid, keep, hist, widths = layout(K, n_ctx, lp)
        source = hidden_states[..., hidden_states.shape[-1] - n_run - n_ctx:]
        tails = [span.entry.conv_tails[lp].to(source.dtype)[None] for span, w in zip(spans, widths) if w]
        source = torch.cat([source, *tails, source.new_zeros(*source.shape[:-1], 1)], dim=-1)
        cap.conv_inputs.append(source[0].index_select(-1, hist.to(source.device)))
        if not len(keep):
            return hidden_states[..., :0]
        out = conv_fn(source.index_select(-1, laid.to(source.device)), *args, **kwargs)
        return out.index_select(-1, keep.to(out.device))

    return conv_wrapper


def advance_body(state: torch.Tensor, span: StitchSpan, layer_pos: int, transition: bool) -> torch.Tensor:
    """`state` after the cached body that follows `span` (unchanged when none follows):
    S <- T S + E, or S <- S + E without `transition` (pic-naive ignores it)."""
    if span.entry is None:
        return state
    op = span.entry.operators[layer_pos]
    return op.apply(state) if transition else state.float() + op.end


def stitch_delta_scan(spans: list[StitchSpan], transition: bool, scan_fn: Callable) -> Callable:
    """A chunked delta-rule kernel (GDN, KDA: `(q, k, v, g, beta, ...) -> (o, state)`) for a fused
    stitch forward: the recurrence runs span by span from the carried state, each cached body's
    operator applied in between, all inside the layer's one call."""
    calls = [0]

    def scan_wrapper(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        lp = calls[0]
        calls[0] += 1
        kwargs.pop("chunk_size", None)
        B, _, hv, dv = value.shape
        # a copy of the cache's state: the layer writes its final state back into that tensor in
        # place, which autograd cannot go back through when the stitch is trained (training/reuse)
        state = (value.new_zeros(B, hv, key.shape[-1], dv, dtype=torch.float32) if initial_state is None
                 else initial_state.to(torch.float32, copy=True))
        outs = []
        for span in spans:
            a, b = span.start, span.end
            if b > a:
                out, state = scan_fn(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                     chunk_size=span_chunk(b - a), initial_state=state, output_final_state=True,
                                     **kwargs)
                outs.append(out)
            state = advance_body(state, span, lp, transition)
        return torch.cat(outs, dim=1), (state if output_final_state else None)

    return scan_wrapper
