"""`ChunkAffinityRouter`: a Ray Serve request router that sends a request to the gateway replica
that already holds most of its chunks, within a load bound.

Modelled on Ray's `PrefixCacheAffinityRouter` (ray.llm): the same hooks, with a chunk directory
(app/serve_ray/directory.py) where that one keeps a prefix tree. A request carries its routing
keys on its first argument (`routing_keys`, set by the ingress: app/serve_ray/keys.py);
`choose_replicas` reads the replicas' queue lengths (Ray's cache, else a probe), asks
`directory.choose` and offers the chosen replica first, then Ray's power-of-two choices as the
fallback rank (taken when the chosen replica refuses: its queue is full). A request without keys
gets power-of-two choices only; one naming a replica (`replica`, from the `X-Hypic-Replica`
request header) goes to that replica when it is running. `on_request_routed` records the keys against the replica that
accepted the request; a replica that dies is forgotten.

`policy="pow2"` keeps every key out of the decision: Ray's default routing, for comparison in
benchmarks, with the same request path.

The directory lives in the router, i.e. in the process holding the deployment handle (the
ingress replica); each ingress replica learns on its own (docs/deploy-ray.md).
"""

from __future__ import annotations

import logging
from typing import List, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from .directory import ChunkDirectory, choose

log = logging.getLogger("hypic.serve_ray")
POLICIES = ("chunk", "pow2")


def request_keys(pending_request: Optional[PendingRequest]) -> tuple[str, ...]:
    """The routing keys a request carries on its first argument (none when absent)."""
    if pending_request is None or not pending_request.args:
        return ()
    keys = getattr(pending_request.args[0], "routing_keys", None)
    return tuple(keys) if isinstance(keys, (tuple, list)) else ()


def request_replica(pending_request: Optional[PendingRequest]) -> Optional[str]:
    """The replica a request asks for by name (`X-Hypic-Replica`), if any."""
    if pending_request is None or not pending_request.args:
        return None
    replica = getattr(pending_request.args[0], "replica", None)
    return replica if isinstance(replica, str) else None


class ChunkAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, policy: str = "chunk", load_bound: int = 2, max_keys: int = 100_000) -> None:
        """`load_bound`: how many more queued requests than the least-loaded replica a chunk
        holder may have and still be chosen; `max_keys`: keys the directory remembers."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if load_bound < 0:
            raise ValueError(f"load_bound must be >= 0, got {load_bound}")
        self.policy = policy
        self.load_bound = load_bound
        self.directory = ChunkDirectory(max_keys)
        self.decisions: dict[str, int] = {}  # reason -> count, for logs and tests

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        pinned = request_replica(pending_request)
        if pinned is not None:
            named = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            if named:
                return [named]
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas=candidate_replicas,
                                                                         pending_request=pending_request)
        keys = request_keys(pending_request)
        if self.policy != "chunk" or not keys or not candidate_replicas:
            return fallback
        loads = await self._queue_lens(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        choice = choose(self.directory.matches(keys, by_id), loads, self.load_bound,
                        {r: self.directory.held(r) for r in by_id})
        if choice is None:
            return fallback
        self.decisions[choice.reason] = self.decisions.get(choice.reason, 0) + 1
        log.debug("routed to %s (%s, %d of %d keys held); loads %s", choice.replica.unique_id, choice.reason, choice.matched,
                  len(keys), {r.unique_id: q for r, q in loads.items()})
        return [[by_id[choice.replica]], *fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = request_keys(pending_request)
        if self.policy == "chunk" and keys:
            self.directory.record(keys, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.directory.forget(replica_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.directory.forget(replica_id)

    async def _queue_lens(self, replicas: List[RunningReplica]) -> dict[ReplicaID, Optional[int]]:
        """Each replica's ongoing requests: from Ray's queue-length cache where fresh, else probed
        (None when a probe gets no answer in time)."""
        loads: dict[ReplicaID, Optional[int]] = {}
        probe: list[RunningReplica] = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                probe.append(r)
            else:
                loads[r.replica_id] = q
        if probe:
            for r, q in await self._probe_queue_lens(probe, 0):
                loads[r.replica_id] = q
        return loads
