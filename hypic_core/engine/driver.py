"""Who drives an engine: the one caller that steps it and routes its outputs by request id.

`Engine.step()` returns every output it produced, whoever's request it was. `generate()` callers
find theirs in their sequence's outbox, but a driver that routes what `step()` returns (the
gateway's engine thread) drops an output it has no route for: two such drivers over one engine
would each drop the other's, and a request would never answer. So a driver claims the engine
first, and a second claim is refused until the first one releases it.
"""

from __future__ import annotations

import threading

from ..errors import EngineBusyError


class DriverClaim:
    """The engine's driver slot (`Engine.driver`)."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._holder: object | None = None
        self._lock = threading.Lock()

    @property
    def holder(self) -> object | None:
        return self._holder

    def claim(self, driver: object) -> None:
        """Make `driver` the engine's driver (again: nothing). Raises EngineBusyError while another holds it."""
        with self._lock:
            if self._holder is not None and self._holder is not driver:
                raise EngineBusyError(f"engine {self.model_id!r} is already driven by {self._holder!r}: one gateway "
                                      "serves an engine at a time (close that one first, or give each its own engine)")
            self._holder = driver

    def release(self, driver: object) -> None:
        """Free the slot if `driver` holds it."""
        with self._lock:
            if self._holder is driver:
                self._holder = None
