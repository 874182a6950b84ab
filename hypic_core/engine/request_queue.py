"""The waiting queue of the scheduler, one class per scheduling policy (vLLM's `request_queue.py`).

`EngineConfig.scheduling` picks one: "fcfs" (arrival order) or "priority" (lowest
`GenerationRequest.priority` first, arrival order among equals). Not thread-safe: the
scheduler guards it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator, Protocol

from .sequence import Sequence


class RequestQueue(Protocol):
    def add(self, seq: Sequence) -> None: ...

    def peek(self) -> Sequence:
        """The next sequence to admit (IndexError when empty)."""

    def pop(self) -> Sequence:
        """Remove and return `peek()`."""

    def remove(self, seq: Sequence) -> None:
        """Remove `seq` (a no-op when absent)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._items.append(seq)

    def peek(self) -> Sequence:
        return self._items[0]

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seq: Sequence) -> None:
        if seq in self._items:
            self._items.remove(seq)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._items))


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []
        self._order = itertools.count()

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.request.priority, next(self._order), seq))

    def peek(self) -> Sequence:
        return self._heap[0][2]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def remove(self, seq: Sequence) -> None:
        kept = [item for item in self._heap if item[2] is not seq]
        if len(kept) != len(self._heap):
            self._heap = kept
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return iter([item[2] for item in sorted(self._heap, key=lambda item: item[:2])])


POLICIES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def queue_for(policy: str) -> RequestQueue:
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {', '.join(POLICIES)}") from None
