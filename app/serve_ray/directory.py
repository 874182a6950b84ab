"""Which replica holds which chunk, and which replica a request should go to.

    directory = ChunkDirectory(max_keys=100_000)
    choice = choose(directory.matches(keys, loads), loads, load_bound=2)
    if choice is not None:            # None: no replica known, let the default policy pick
        directory.record(keys, choice.replica)

A *routing key* names a chunk of a request (app/serve_ray/keys.py): a retrieved chunk by its
chunk id, a given segment by a hash of its text. The directory remembers, for the `max_keys`
keys most recently routed, the replicas a request carrying that key was sent to: those replicas
computed the chunk and hold it in their segment cache (unless their own LRU dropped it since;
the directory is a hint, never a correctness condition: a wrong guess costs a cache miss).

Policy (`choose`): among replicas whose queue is at most `load_bound` above the least-loaded
replica's, the one holding the most of the request's keys (ties: the shorter queue, then the
fewer keys held); if no such replica holds any of them, the least-loaded replica, ties broken
by fewer keys held, so new chunks spread over the replicas' caches. Replicas with an unknown
queue length take no part. No Ray here: the router (app/serve_ray/router.py) feeds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

Replica = Hashable


@dataclass(frozen=True)
class Choice:
    """Where a request goes: `replica`, how many of its keys that replica holds (`matched`), and why:
    "affinity" (the best holder within the bound), "diverted" (holders exist but are over the
    bound or of unknown load: least-loaded instead), "spread" (no replica holds any key: least-loaded)."""

    replica: Replica
    matched: int
    reason: str


class ChunkDirectory:
    """Routing key -> the replicas it was routed to, for the `max_keys` most recently routed keys.
    Not thread-safe: one router (one event loop) owns it."""

    def __init__(self, max_keys: int = 100_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._holders: OrderedDict[str, dict[Replica, None]] = OrderedDict()  # insertion-ordered sets
        self._held: dict[Replica, int] = {}  # keys held per replica

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, keys: Iterable[str], replica: Replica) -> None:
        """`replica` now holds `keys` (it was sent a request carrying them); evicts the least
        recently routed keys beyond `max_keys`."""
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = {}
            else:
                self._holders.move_to_end(key)
            if replica not in holders:
                holders[replica] = None
                self._held[replica] = self._held.get(replica, 0) + 1
        while len(self._holders) > self.max_keys:
            _, holders = self._holders.popitem(last=False)
            for r in holders:
                self._drop_count(r)

    def forget(self, replica: Replica) -> None:
        """`replica` is gone (died, scaled down): it holds nothing any more."""
        for key in [k for k, holders in self._holders.items() if replica in holders]:
            holders = self._holders[key]
            del holders[replica]
            if not holders:
                del self._holders[key]
        self._held.pop(replica, None)

    def holders(self, key: str) -> tuple[Replica, ...]:
        return tuple(self._holders.get(key, ()))

    def held(self, replica: Replica) -> int:
        """How many keys the directory says `replica` holds."""
        return self._held.get(replica, 0)

    def matches(self, keys: Sequence[str], replicas: Iterable[Replica]) -> dict[Replica, int]:
        """For each of `replicas`, how many distinct `keys` it holds."""
        out = {r: 0 for r in replicas}
        for key in set(keys):
            for r in self._holders.get(key, ()):
                if r in out:
                    out[r] += 1
        return out

    def _drop_count(self, replica: Replica) -> None:
        n = self._held.get(replica, 0) - 1
        if n > 0:
            self._held[replica] = n
        else:
            self._held.pop(replica, None)


def choose(matched: Mapping[Replica, int], loads: Mapping[Replica, int | None], load_bound: int,
           held: Mapping[Replica, int] | None = None) -> Choice | None:
    """The replica for a request (module docstring), or None when no replica has a known queue
    length. `matched`: keys of the request each replica holds; `loads`: queue lengths (None:
    unknown); `held`: keys each replica holds in all (tie-break when spreading)."""
    if load_bound < 0:
        raise ValueError(f"load_bound must be >= 0, got {load_bound}")
    known = {r: q for r, q in loads.items() if q is not None}
    if not known:
        return None
    held = held or {}
    least = min(known.values())
    within = [r for r, q in known.items() if q - least <= load_bound]
    best = max(within, key=lambda r: (matched.get(r, 0), -known[r], -held.get(r, 0)))
    if matched.get(best, 0) > 0:
        return Choice(best, matched[best], "affinity")
    spread = min(within, key=lambda r: (known[r], held.get(r, 0)))
    reason = "diverted" if any(n > 0 for n in matched.values()) else "spread"
    return Choice(spread, matched.get(spread, 0), reason)
