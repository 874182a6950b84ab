"""Prometheus metrics of one gateway, in its own registry (several apps can live in one process).

Every series carries a `model_name` label (the served model), added at scrape time. Latencies
are in seconds. `hypic_prompt_tokens{kind}` partitions every prompt, so the kinds sum to the
prompt tokens: `exact` (restored from an exact snapshot), `composed` (segment bodies
reused from the cache by position-independent composition), `seam` (seam heads recomputed in
context), `fresh` (everything else computed for the request: the question, cold segments,
full/prefix forwards). Segment-store counters are read from `store.stats()` at scrape time, as
`lookups` / `hits` pairs per tier (hit rate = hits / lookups). The standard process, platform and
GC collectors are included.
"""

from __future__ import annotations

from typing import Callable

import copy

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hypic_core.cache.store import SegmentStore
from hypic_core.engine.sequence import PrefillStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
disable_created_metrics()  # process-wide: no `*_created` series, they only add noise to scrapes


class Metrics:
    """The gateway's instruments. Methods are thread-safe (prometheus-client is)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name  # the `model_name` label of every series; the runtime sets it once loaded
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter("hypic_requests", "HTTP requests by route template (a request refused before routing, "
                                "e.g. 401 or 413, under the route its path names; 'unmatched': a path no route has, "
                                "e.g. 404) and status code.", ["route", "status"], registry=r)
        self.ttft = Histogram("hypic_time_to_first_token_seconds", "Request arrival to first generated token.",
                              ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hypic_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("hypic_e2e_latency_seconds", "Request arrival to last generated token.",
                             ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.retrieval = Histogram("hypic_retrieval_seconds", "Vector search time per request.",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("hypic_queue_seconds", "Time a request waited in the engine before its prefill started.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("hypic_prefill_seconds", "Engine prefill time per request.",
                                 ["mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("hypic_prompt_tokens", "Prompt tokens by how their work was done (a partition: exact, "
                                     "composed, seam, fresh).", ["kind"], registry=r)
        self.generated_tokens = Counter("hypic_generated_tokens", "Generated tokens.", registry=r)
        self.segments = Counter("hypic_segment_lookups", "Context segments looked up per request.", ["result"], registry=r)
        self.cold_exact = Counter("hypic_cold_exact_forwards", "Cold requests served by one exact forward over the prompt "
                                  "(cold_prefill), their missing entries computed after the first token.", registry=r)
        self.finished = Counter("hypic_generations_finished", "Finished generations by finish reason.", ["reason"], registry=r)
        self.rejected = Counter("hypic_requests_rejected", "Requests refused at admission (queue full).", registry=r)
        self.running = Gauge("hypic_requests_running", "Generations prefilling or decoding in the engine.", registry=r)
        self.waiting = Gauge("hypic_requests_waiting", "Admitted generations waiting for the engine to start them.", registry=r)
        # Tenants (app/service/tenants.py): label values are the configured tenants, at most 64, the rest "other".
        self.tenant_requests = Counter("hypic_tenant_requests", "Requests by tenant and status code (the probes excepted).",
                                       ["tenant", "status"], registry=r)
        self.tenant_in_flight = Gauge("hypic_tenant_requests_in_flight", "Requests of each tenant in flight.", ["tenant"],
                                      registry=r)
        self.tenant_prompt_tokens = Counter("hypic_tenant_prompt_tokens", "Prompt tokens by tenant and how their work was "
                                            "done (the kinds of hypic_prompt_tokens).", ["tenant", "kind"], registry=r)
        self.tenant_refused = Counter("hypic_tenant_quota_refusals", "Requests a tenant's quota refused (429), by the "
                                      "limit: documents, bytes, collections, requests.", ["tenant", "limit"], registry=r)

    def watch_speculation(self, stats) -> None:
        """Export the engine's speculative-decoding counters (`Engine.speculation`, read at each scrape)."""
        self.registry.register(_SpeculationCollector(stats))

    def watch_lookups(self, lookups) -> None:
        """Export the engine's stored-tier lookups (`Engine.lookups`, hypic_core/engine/lookups.py; None: a store
        all in memory): requests waiting for them, and requests laid out at their deadline without them."""
        if lookups is not None:
            self.registry.register(_LookupsCollector(lookups))

    def watch_store(self, store: SegmentStore) -> None:
        """Export `store.stats()` (hits by tier, misses, evictions, corrupt entries, bytes by tier)."""
        self.registry.register(_StoreCollector(store.stats))

    def observe_prefill(self, stats: PrefillStats, tenant: str | None = None) -> None:
        self.queue.observe(stats.timings_ms.get("queue", 0.0) / 1000.0)
        self.prefill.labels(stats.mode).observe(stats.timings_ms.get("prefill", 0.0) / 1000.0)
        for kind in ("exact", "composed", "seam", "fresh"):
            self.prompt_tokens.labels(kind).inc(getattr(stats, f"{kind}_tokens"))
            if tenant is not None:
                self.tenant_prompt_tokens.labels(tenant, kind).inc(getattr(stats, f"{kind}_tokens"))
        self.segments.labels("hit").inc(stats.segment_hits)
        self.segments.labels("miss").inc(stats.segment_misses)
        if stats.exact_forward:
            self.cold_exact.inc()

    def render(self) -> bytes:
        return generate_latest(_WithLabel(self.registry, "model_name", self.model_name))


class _WithLabel:
    """A registry view that adds one label to every sample of `registry`."""

    def __init__(self, registry: CollectorRegistry, name: str, value: str) -> None:
        self._registry, self._name, self._value = registry, name, value

    def collect(self):
        for metric in self._registry.collect():
            labelled = copy.copy(metric)
            labelled.samples = [s._replace(labels={**s.labels, self._name: self._value}) for s in metric.samples]
            yield labelled


class _SpeculationCollector:
    def __init__(self, stats) -> None:
        self._stats = stats

    def collect(self):
        s = self._stats
        yield CounterMetricFamily("hypic_speculation_drafted_tokens", "Draft tokens fed to verification forwards "
                                  "(speculative decoding).", value=s.drafted)
        yield CounterMetricFamily("hypic_speculation_accepted_tokens", "Draft tokens the model agreed with (each "
                                  "emitted without a decode step of its own).", value=s.accepted)
        yield CounterMetricFamily("hypic_speculation_verify_steps", "Decode steps run as one verification forward.",
                                  value=s.verify_steps)


class _LookupsCollector:
    def __init__(self, lookups) -> None:
        self._lookups = lookups

    def collect(self):
        yield GaugeMetricFamily("hypic_cache_lookup_waiting_requests", "Requests waiting for their disk or Redis "
                                "lookups (off the engine thread) before they are scheduled.", value=self._lookups.pending)
        yield CounterMetricFamily("hypic_cache_lookup_late_requests", "Requests laid out at their lookup deadline "
                                  "(HYPIC_LOOKUP_DEADLINE_S) with stored-tier lookups still out: a slow or stopped tier.",
                                  value=self._lookups.late)


class _StoreCollector:
    def __init__(self, read: Callable) -> None:
        self._read = read

    def collect(self):
        stats = self._read()
        tiers = set(stats.hits) | set(stats.tier_misses)
        yield _by_tier(CounterMetricFamily, "hypic_cache_lookups", "Segment-store lookups that reached each tier "
                       "(hit rate of a tier = hits / lookups).",
                       {t: stats.hits.get(t, 0) + stats.tier_misses.get(t, 0) for t in tiers})
        yield _by_tier(CounterMetricFamily, "hypic_cache_hits", "Segment-store hits by tier.", stats.hits)
        yield _by_tier(CounterMetricFamily, "hypic_cache_tier_misses", "Lookups that reached a tier and missed there.",
                       stats.tier_misses)
        yield _by_tier(CounterMetricFamily, "hypic_cache_load_seconds", "Time spent serving hits, by tier.", stats.load_seconds)
        yield CounterMetricFamily("hypic_cache_misses", "Segment-store lookups no tier answered.", value=stats.misses)
        stored = stats.tiers
        yield _by_tier(CounterMetricFamily, "hypic_cache_tier_writes", "Values written by each stored tier.",
                       {t: s.writes for t, s in stored.items()})
        yield _by_tier(CounterMetricFamily, "hypic_cache_tier_dropped_writes", "Stored-tier writes skipped (queue full, "
                       "tier down or the write failed).", {t: s.dropped_writes for t, s in stored.items()})
        yield _by_tier(CounterMetricFamily, "hypic_cache_tier_errors", "Stored-tier I/O or network failures.",
                       {t: s.errors for t, s in stored.items()})
        yield _by_tier(GaugeMetricFamily, "hypic_cache_tier_available", "1 while a stored tier is used, 0 while it is "
                       "skipped (a server not reached, a disk directory that would not open: retried in the background).",
                       {t: int(s.available) for t, s in stored.items()})
        yield _by_tier(CounterMetricFamily, "hypic_cache_tier_repaired", "Damage a stored tier removed in place (symbolic "
                       "links under the disk tier's directory).", {t: s.repaired for t, s in stored.items()})
        yield _by_tier(GaugeMetricFamily, "hypic_cache_tier_connected", "1 while a networked tier reaches its server, "
                       "0 while it is skipped.", {t: int(s.connected) for t, s in stored.items() if s.connected is not None})
        # The per-tier series above supersede these (kept for existing dashboards).
        yield CounterMetricFamily("hypic_cache_dropped_writes", "Disk writes skipped (queue full or I/O error).", value=stats.dropped_writes)
        yield CounterMetricFamily("hypic_cache_disk_errors", "Disk-tier I/O failures.", value=stats.disk_errors)
        yield CounterMetricFamily("hypic_cache_disk_damaged", "Disk-tier directories found damaged at startup, moved aside "
                                  "and started empty.", value=stats.disk_damaged)
        if stats.redis_connected is not None:
            yield CounterMetricFamily("hypic_cache_redis_errors", "Failed calls to the shared Redis tier (it is skipped "
                                      "until it answers again).", value=stats.redis_errors)
            yield CounterMetricFamily("hypic_cache_redis_dropped_writes", "Redis-tier writes skipped (queue full, server "
                                      "down or the write failed).", value=stats.redis_dropped_writes)
            yield GaugeMetricFamily("hypic_cache_redis_connected", "1 while the Redis tier reaches its server, 0 while it "
                                    "is skipped.", value=stats.redis_connected)
        yield CounterMetricFamily("hypic_cache_evictions", "Segment-store entries evicted for space.", value=stats.evictions)
        yield CounterMetricFamily("hypic_cache_corrupt", "Segment-store entries found damaged or foreign.", value=stats.corrupt)
        yield _by_tier(GaugeMetricFamily, "hypic_cache_bytes", "Bytes held by each segment-store tier.", stats.bytes)


def _by_tier(family_cls, name: str, documentation: str, values: dict):
    """One metric family with a `tier` label and one sample per tier, tiers in name order."""
    family = family_cls(name, documentation, labels=["tier"])
    for tier, value in sorted(values.items()):
        family.add_metric([tier], value)
    return family
