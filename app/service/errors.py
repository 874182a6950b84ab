"""What the service refuses, as domain errors. Nothing here knows HTTP: app/http/errors.py maps each
one to its status code and JSON body, in one place.

- `InvalidRequestError(field, message)` (the engine's, `hypic_core.errors`): a bad request, naming
  the field; the engine's `PromptTooLongError` and the subclasses here say more precisely why.
- `QueueFullError`: admission refused, the engine thread already holds `capacity` requests.
- `NotReadyError`: the model or the index is not loaded (still loading, or loading failed).
- `QuotaExceededError`: a tenant's limit (documents, bytes, requests in flight) refuses the request.
"""

from __future__ import annotations

from hypic_core.errors import InvalidRequestError

__all__ = ["CollectionReadOnlyError", "NotReadyError", "QueueFullError", "QuotaExceededError", "TextTooLongError",
           "TooManyItemsError", "UnknownCollectionError", "UnknownDocumentError"]


class TooManyItemsError(InvalidRequestError):
    """A list field holds more entries (document ids, stop strings) or bytes than a setting allows."""


class TextTooLongError(InvalidRequestError):
    """The request's text passes `max_text_bytes` at `field`."""


class UnknownDocumentError(InvalidRequestError):
    """A field names a document the index does not hold."""


class UnknownCollectionError(InvalidRequestError):
    """A field names a collection the tenant does not have."""


class CollectionReadOnlyError(InvalidRequestError):
    """A write to a shared collection the tenant may only read."""


class QuotaExceededError(Exception):
    """A tenant's `limit` ("documents", "bytes", "collections" or "requests") refuses the request."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class QueueFullError(Exception):
    """Admission refused: the engine thread already holds `capacity` requests."""

    def __init__(self, capacity: int) -> None:
        super().__init__(f"server busy: {capacity} requests running or queued; retry later")
        self.capacity = capacity


class NotReadyError(Exception):
    """The model and index are not loaded: `detail` says whether they are loading or why loading failed."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"not ready: {detail}")
        self.detail = detail
