"""Parallel cold prefill: a pool of model replicas computing canonical entries (docs/architecture.md)."""

from .backends import BACKENDS
from .pool import PrefillPool
from .replica import ReplicaSpec

__all__ = ["BACKENDS", "PrefillPool", "ReplicaSpec"]
