"""Connector statistics for vLLM's periodic stats line and ``/metrics``.

vLLM asks every worker and the scheduler for ``get_kv_connector_stats()`` each step, sums them with
``aggregate`` (across tensor-parallel workers and steps), logs ``reduce()`` with its periodic stats line and hands
the same data to our Prometheus families (``build_prom_metrics``). The data is a plain dict (it crosses process
boundaries): counters, bytes per vLLM KV-cache group and per storage tier, and the seconds of each load and store
for the histograms.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

PREFIX = "vllm:lmcache_platforms_"
COUNTERS: dict[str, str] = {
    "lookups": "requests the scheduler asked LMCache about",
    "hit_tokens": "tokens LMCache reported as hits beyond vLLM's own prefix cache",
    "chunks_stored": "chunk objects written to LMCache",
    "bytes_stored": "KV bytes written to LMCache",
    "chunks_loaded": "chunk objects read from LMCache into the KV cache",
    "bytes_loaded": "KV bytes read from LMCache into the KV cache",
    "loads_failed": "loads reported failed to vLLM (the request is recomputed or failed, per its policy)",
    "resets": "prefix-cache resets the connector took: nothing stored before is looked up again",
    "remote_lookups_timed_out": "asks the remote store did not answer within platforms.remote_lookup_timeout_s",
    "remote_lookups_skipped": "remote-store asks answered as misses unasked: the store is skipped after a time-out",
}
FAILURE_CAUSES: dict[str, str] = {
    "missing": "LMCache returned fewer tokens than it had claimed (evicted, deleted or cut object, store down)",
    "corrupt": "a chunk object failed its checksum (it was removed from every tier)",
    "timeout": "no answer within platforms.load_timeout_s",
    "error": "the load raised (a kernel error, a wrong-size object)",
    "unregistered": "the KV caches were unregistered (vLLM sleep mode)",
}
"""Why a load failed: the ``cause`` label of ``loads_failed_total``; counted as ``failed_<cause>`` in the data."""
FAILED = {cause: f"failed_{cause}" for cause in FAILURE_CAUSES}
COUNTED = (*COUNTERS, *FAILED.values())
"""Every count the data carries (summed over workers and steps)."""
LABELLED: dict[str, tuple[str, str]] = {
    "group_bytes_stored": ("kv_group", "KV bytes of one vLLM KV-cache group written to LMCache (its rows, without "
                                       "the chunk objects' checksum trailer and padding)"),
    "group_bytes_loaded": ("kv_group", "KV bytes of one vLLM KV-cache group read from LMCache into the KV cache"),
    "tier_bytes_read": ("tier", "chunk object bytes LMCache read from one storage tier (its backend's name) for "
                                "loads"),
}
"""Counts by one label (name -> label, documentation): in the data, ``{label value as str: count}`` (summed over
workers and steps); on ``/metrics``, that label."""
TIMINGS: dict[str, str] = {
    "store_seconds": "seconds one request's store took (LMCache's store call, copy included)",
    "load_seconds": "seconds one request's load took (LMCache's retrieve call, copy included)",
}
# Timings kept between two takes: a wrapper that never takes them (vLLM's LMCacheConnectorV1) costs this much.
MAX_TIMINGS = 4096
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _empty() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTED, 0), **{name: {} for name in LABELLED}, **{name: [] for name in TIMINGS}}


def _add_labelled(into: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    return {**into, **{value: into.get(value, 0) + count for value, count in counts.items()}}


class PlatformsConnectorStats(KVConnectorStats):
    """Counters summed and timings concatenated over workers and steps."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data={**_empty(), **(data or {})})

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTED:
            self.data[name] += other.data.get(name, 0)
        for name in LABELLED:
            self.data[name] = _add_labelled(self.data[name], other.data.get(name, {}))
        for name in TIMINGS:
            self.data[name] = [*self.data[name], *other.data.get(name, ())]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's counters, and the mean of each timing in milliseconds."""
        reduced: dict[str, int | float] = {name: self.data[name] for name in COUNTERS}
        reduced.update({name: self.data[name] for name in FAILED.values() if self.data[name]})
        for name in TIMINGS:
            values = self.data[name]
            reduced[f"{name.removesuffix('_seconds')}_ms_mean"] = (
                round(1000 * sum(values) / len(values), 3) if values else 0.0)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in (*COUNTERS, *LABELLED, *TIMINGS))


class StatsRecorder:
    """What one connector side saw since vLLM last took its stats; thread-safe (loads run on a loader thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTED, 0)
        self._labelled: dict[str, dict[str, int]] = {name: {} for name in LABELLED}
        self._timings: dict[str, deque[float]] = {name: deque(maxlen=MAX_TIMINGS) for name in TIMINGS}
        self._seen: dict[str, int] = {}
        self._dirty = False  # anything recorded since the last take: vLLM takes stats every step, mostly idle
        self.totals = dict.fromkeys(COUNTED, 0)
        """Every count since the connector started, never reset by a take (the fault tests read it in-process)."""

    def count(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value
            self.totals[name] += value
            self._dirty = True

    def advance(self, name: str, total: int) -> None:
        """Count ``name`` up to ``total``, a running count kept elsewhere (what it gained since the last call)."""
        with self._lock:
            gained = total - self._seen.get(name, 0)
            self._seen[name] = total
            if gained > 0:
                self._counts[name] += gained
                self.totals[name] += gained
                self._dirty = True

    def count_labelled(self, name: str, counts: Mapping[Any, int]) -> None:
        """Count ``name`` (a key of ``LABELLED``) for each label value of ``counts`` (a group index, a tier)."""
        gained = {str(value): count for value, count in counts.items() if count}
        with self._lock:
            self._labelled[name] = _add_labelled(self._labelled[name], gained)
            self._dirty = self._dirty or bool(gained)

    def failed_load(self, cause: str) -> None:
        """One load reported failed to vLLM, for ``cause`` (a key of ``FAILURE_CAUSES``)."""
        if cause not in FAILURE_CAUSES:
            raise ValueError(f"unknown failed-load cause {cause!r}; known: {', '.join(FAILURE_CAUSES)}")
        with self._lock:
            for name in ("loads_failed", FAILED[cause]):
                self._counts[name] += 1
                self.totals[name] += 1
            self._dirty = True

    def timing(self, name: str, seconds: float) -> None:
        with self._lock:
            self._timings[name].append(seconds)
            self._dirty = True

    def take(self) -> PlatformsConnectorStats | None:
        """The stats since the last take (None when nothing happened), and start afresh."""
        if not self._dirty:  # read without the lock: a record racing this take is taken at the next step
            return None
        with self._lock:
            self._dirty = False
            data = {**self._counts, **self._labelled,
                    **{name: list(values) for name, values in self._timings.items()}}
            self._counts = dict.fromkeys(self._counts, 0)
            self._labelled = {name: {} for name in LABELLED}
            for values in self._timings.values():
                values.clear()
        stats = PlatformsConnectorStats(data)
        return None if stats.is_empty() else stats
def _per_engine(metrics: dict[str, Any], labelvalues: dict[int, list[object]]) -> dict[int, dict[str, Any]]:
    """Each metric with each engine's label values bound."""
    return {engine: {name: metric.labels(*values) for name, metric in metrics.items()}
            for engine, values in labelvalues.items()}


class PlatformsPromMetrics(KVConnectorPromMetrics):
    """``vllm:lmcache_platforms_*_total`` counters (with one more label where ``LABELLED``) and ``*_seconds``
    histograms, per vLLM engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types its metric classes as one union; these are its Counter and Histogram.
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        counters = {name: counter(name=f"{PREFIX}{name}", documentation=doc, labelnames=labelnames)
                    for name, doc in COUNTERS.items() if name != "loads_failed"}
        failed = counter(name=f"{PREFIX}loads_failed", documentation=COUNTERS["loads_failed"],
                         labelnames=[*labelnames, "cause"])
        histograms = {name: histogram(name=f"{PREFIX}{name}", documentation=doc, buckets=list(BUCKETS),
                                      labelnames=labelnames) for name, doc in TIMINGS.items()}
        self._labelled = {name: counter(name=f"{PREFIX}{name}", documentation=doc, labelnames=[*labelnames, label])
                          for name, (label, doc) in LABELLED.items()}
        self._labelvalues = per_engine_labelvalues
        self._counters = _per_engine(counters, per_engine_labelvalues)
        # Every cause's sample exists from the start (at 0), so a dashboard's rate() has a series to read.
        self._failed = {engine: {FAILED[cause]: failed.labels(*values, cause) for cause in FAILURE_CAUSES}
                        for engine, values in per_engine_labelvalues.items()}
        self._histograms = _per_engine(histograms, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, metric in (*self._counters[engine_idx].items(), *self._failed[engine_idx].items()):
            if transfer_stats_data.get(name):
                metric.inc(transfer_stats_data[name])
        for name, metric in self._histograms[engine_idx].items():
            for seconds in transfer_stats_data.get(name, ()):
                metric.observe(seconds)
        for name, family in self._labelled.items():
            for value, count in transfer_stats_data.get(name, {}).items():
                family.labels(*self._labelvalues[engine_idx], value).inc(count)
