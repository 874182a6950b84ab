"""Exceptions raised by the engine. Every message names the offending input."""

from __future__ import annotations


class HypicError(Exception):
    """Base class for all engine errors."""


class UnsupportedArchitectureError(HypicError):
    """The model's architecture cannot be served with position-independent caching."""


class InvalidRequestError(HypicError, ValueError):
    """A request is malformed. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLongError(InvalidRequestError):
    """The assembled prompt (plus requested generation) exceeds the model's context."""


class EngineBusyError(HypicError):
    """An engine already has a driver (a gateway's engine thread) and another one tried to claim it."""
