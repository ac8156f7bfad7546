"""The Ray Serve request router of the pipeline replicas: cache affinity, then the less loaded of two.

Ray Serve calls ``choose_replicas`` for each request a ``DeploymentHandle`` sends; it returns ranks
of replicas, and Serve takes the least loaded replica of the first rank that has one with room
(``max_ongoing_requests``), probing queue lengths where its cache has none.

- A request with a ``routing_key`` (``pipeline.scaleout.affinity``) ranks first the replica that owns the key
  on a consistent-hash ring of the running replicas, unless that replica is busy: full, or more
  than ``busy_slack`` requests above the least loaded replica Serve knows of. Then comes the
  power-of-two-choices rank, which is all a request without a key gets.
- A request with ``replica`` (a replica's full id) goes to that replica: the ingress asks every
  replica for its health and metrics this way. While that replica is not running (starting, or
  gone) the request goes anywhere, and the answer's ``X-Replica`` tells the caller so.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pipeline.scaleout.affinity import HashRing

__all__ = ["AffinityRouter"]


class AffinityRouter(RequestRouter):
    def initialize_state(self, busy_slack: int = 4, **kwargs: object) -> None:  # Serve passes request_router_kwargs
        self.busy_slack = busy_slack
        self._ring = HashRing(())
        self._ring_members: frozenset[str] = frozenset()

    def _ring_of(self, replica_ids: Iterable[str]) -> HashRing:
        members = frozenset(replica_ids)
        if members != self._ring_members:  # rebuilt only when replicas come or go
            self._ring, self._ring_members = HashRing(members), members
        return self._ring

    def _busy(self, replica: RunningReplica, replicas: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        queue = cache.get(replica.replica_id)
        if queue is None:
            return False  # unknown: Serve probes it before it sends anything
        if queue >= replica.max_ongoing_requests:
            return True
        known = [q for r in replicas if (q := cache.get(r.replica_id)) is not None]
        return queue > min(known) + self.busy_slack

    @staticmethod
    def _two_choices(replicas: list[RunningReplica]) -> list[RunningReplica]:
        return random.sample(replicas, min(2, len(replicas)))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        target = kwargs.get("replica")
        if target in by_id:
            return [[by_id[target]]]
        # A target not running (yet) is routed like any request: the caller sees another replica
        # answered. Returning no rank would leave the request waiting in Serve's router.
        ranks = []
        key = kwargs.get("routing_key")
        if key:
            owner = by_id[self._ring_of(by_id).node(key)]
            if not self._busy(owner, candidate_replicas):
                ranks.append([owner])
        ranks.append(self._two_choices(candidate_replicas))
        return ranks
