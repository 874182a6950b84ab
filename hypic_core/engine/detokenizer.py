"""Incremental detokenization with stop strings, for streaming.

`push(token)` returns the text that is safe to emit now: never half of a multi-byte
character, never a prefix of a stop string that the next tokens might complete; `flush()` the
rest; `stopped` is set once a stop string appeared (the text ends before it).

`IncrementalDetokenizer` is the fast path: `tokenizers`' `DecodeStream` decodes each new token
from a short window of ids, so a token costs the same whatever came before. `StreamDetokenizer`
is the plain reference it is tested against: it decodes the whole output on every token.
`detokenizer_for` picks the fast one when the tokenizer has a `tokenizers` backend.
"""

from __future__ import annotations

from typing import Sequence

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


def detokenizer_for(tokenizer, stop: Sequence[str] = ()):
    """An `IncrementalDetokenizer` when `tokenizer` has a `tokenizers` backend, else a `StreamDetokenizer`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and DecodeStream is not None:
        return IncrementalDetokenizer(backend, stop)
    return StreamDetokenizer(tokenizer, stop)


class IncrementalDetokenizer:
    """`push` / `flush` / `stopped` as `StreamDetokenizer`, on a `tokenizers.Tokenizer` (`backend`), with
    special tokens skipped. Only the text not yet emitted is kept: a stop string cannot start in
    emitted text, because any suffix that could begin one is held back."""

    def __init__(self, backend, stop: Sequence[str] = ()):
        self.backend = backend
        self.stop = tuple(stop)
        self.stopped = False
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held = ""  # decoded, not yet emitted
        self._undecoded: list[int] = []  # ids the stream holds (an incomplete character)

    def push(self, token_id: int) -> str:
        """Add a token; return newly safe text. Sets `stopped` when a stop string appears."""
        piece = self._stream.step(self.backend, token_id)
        if piece is None:
            self._undecoded.append(token_id)
        else:
            self._undecoded = []
            self._held += piece
        for s in self.stop:
            at = self._held.find(s)
            if at != -1:
                self.stopped = True
                out, self._held = self._held[:at], ""
                return out
        safe = len(self._held) - _stop_prefix_len(self._held, self.stop)
        out, self._held = self._held[:safe], self._held[safe:]
        return out

    def flush(self) -> str:
        """Everything not yet emitted (call when generation ends); an incomplete character as U+FFFD."""
        if self._undecoded and not self.stopped:
            self._held += self.backend.decode(self._undecoded, skip_special_tokens=True)
        out, self._held, self._undecoded = self._held, "", []
        return out


class StreamDetokenizer:
    """The reference: decodes every token id so far on each `push`."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.emitted = 0  # chars of `text` already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return newly safe text. Sets `stopped` when a stop string appears."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.stopped = True
                self.text = self.text[:at]
                return self._emit(len(self.text))
        safe = len(self.text)
        if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            safe -= 1
        safe -= self._stop_prefix_len(self.text[:safe])
        return self._emit(max(safe, self.emitted))

    def flush(self) -> str:
        """Everything not yet emitted (call when generation ends)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out, self.emitted = self.text[self.emitted : upto], max(self.emitted, upto)
        return out

    def _stop_prefix_len(self, text: str) -> int:
        return _stop_prefix_len(text, self.stop)


def _stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
