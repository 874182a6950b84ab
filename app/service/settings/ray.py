"""Several replicas on Ray Serve (`hypic serve-ray`; docs/deploy-ray.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import AreaSettings


class RaySettings(AreaSettings):
    """Gateway replicas on Ray Serve and the router in front of them."""

    ray_address: str | None = Field(None, description="Ray cluster to join (`auto`: the one `ray start` began on this "
                                    "machine; `ray://host:10001`: a remote one); unset: start a local Ray instance. Used by `hypic serve-ray` "
                                    "and by prefill_backend=ray.")
    ray_replicas: int = Field(2, ge=1, description="Gateway replicas (each loads the model and keeps its own cache tiers).")
    ray_router: Literal["chunk", "pow2"] = Field("chunk", description="chunk: to the replica holding most of a request's "
                                                 "chunks, within ray_load_bound; pow2: Ray's power-of-two choices.")
    ray_load_bound: int = Field(2, ge=0, description="A chunk holder is chosen only while its ongoing requests exceed the "
                                "least-loaded replica's by at most this; beyond: the least-loaded replica.")
    ray_directory_keys: int = Field(100_000, ge=1, description="Chunk keys the router remembers (least recently routed dropped).")
    ray_replica_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per gateway replica.")
    ray_replica_gpus: float | None = Field(None, ge=0, description="GPUs per replica; unset: 1 when device is cuda, else 0.")
    ray_ingress_replicas: int = Field(1, ge=1, description="Ingress replicas (each keeps its own chunk directory).")
    ray_health_check_s: float = Field(10.0, gt=0, description="How often Serve checks each replica; one whose model failed "
                                      "to load (with exit_on_load_failure) or whose engine thread died is replaced.")
    ray_max_ongoing_requests: int | None = Field(None, ge=1, description="Requests Ray sends one replica at once; "
                                                 "unset: max_running + max_queue. More wait in the ingress.")
