"""Incremental detokenization with stop strings, for streaming.

`push(token)` returns the text that is safe to emit now: never half of a multi-byte
character, never a prefix of a stop string that the next tokens might complete.
"""

from __future__ import annotations

from typing import Sequence


class StreamDetokenizer:
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
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
