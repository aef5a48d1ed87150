"""Read a server's connector statistics from its ``/metrics``: hit rate, bytes, load and store time, failed loads
by cause, since the server started and, with ``--interval S``, over the next S seconds (two samples' difference).

URL is the server's base URL (``http://host:port``) or its ``/metrics`` page. Every figure is summed over the
label sets a server exports (vLLM's ``engine`` and ``model_name``). A table by default; with ``--json`` the last
line printed is one JSON object instead. A server that cannot be read, answers something other than Prometheus
text or exports none of the connector's families is named on one stderr line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from lmcache_platforms.cli.tables import fields_table

PREFIX = "vllm:lmcache_platforms_"
"""The connector's families on ``/metrics`` (``integration.vllm.stats.PREFIX``; read here without importing vLLM)."""
PROMPT_TOKENS = "vllm:prompt_tokens_total"
"""vLLM's own count of prompt tokens, every request's whole prompt: the hit rate's denominator."""
COUNTERS = ("lookups", "hit_tokens", "chunks_stored", "bytes_stored", "chunks_loaded", "bytes_loaded")
"""The connector's plain counters shown (``<PREFIX><name>_total``)."""
TIMINGS = ("load_seconds", "store_seconds")
"""The connector's histograms: their ``_sum`` and ``_count`` are read."""
BY_LABEL = {"loads_failed": "cause", "tier_bytes_read": "tier"}
"""Counters shown per value of one label (``<name>.<value>`` in a sample's totals)."""


class StatsError(Exception):
    """A user's mistake (wrong URL, not our server): one line on stderr, exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server's base URL (http://host:port) or its /metrics URL")
    parser.add_argument("--interval", type=float, metavar="SECONDS",
                        help="also show the figures over this many seconds: two samples, their difference")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                        help="how long one read of /metrics may take (default: 30; a busy server can be slow)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object as the last line instead of the table")


def metrics_url(url: str) -> str:
    """``url`` as the ``/metrics`` page to read: a base URL gets ``/metrics``; no scheme means ``http://``."""
    url = url if "://" in url else f"http://{url}"
    return url if url.rstrip("/").endswith("/metrics") else f"{url.rstrip('/')}/metrics"


def fetch(url: str, timeout_s: float) -> str:
    """The page's text; any failure to read it (refused, unknown host, HTTP error, time-out) as a StatsError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise StatsError(f"cannot read {url}: {exc}") from exc
    except urllib.error.URLError as exc:
        raise StatsError(f"cannot read {url}: {exc.reason}") from exc
    except (OSError, ValueError) as exc:  # a time-out while reading; a URL urllib cannot open
        raise StatsError(f"cannot read {url}: {exc}") from exc


def totals(text: str, url: str) -> dict[str, float]:
    """The counts a page shows, summed over label sets: ``prompt_tokens``, each of ``COUNTERS``, each timing's
    ``_sum``/``_count``, and ``<name>.<label value>`` for ``BY_LABEL``."""
    try:
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except ValueError as exc:
        raise StatsError(f"{url} did not answer Prometheus text ({exc})") from exc
    if not any(sample.name.startswith(PREFIX) for sample in samples):
        raise StatsError(f"{url} exports none of the connector's families ({PREFIX}*): LMCachePlatformsConnector "
                         "is probably not configured (--kv-transfer-config)")
    wanted = {f"{PREFIX}{name}_total": name for name in COUNTERS}
    wanted.update({f"{PREFIX}{name}{part}": f"{name}{part}" for name in TIMINGS for part in ("_sum", "_count")})
    found: dict[str, float] = dict.fromkeys(["prompt_tokens", *wanted.values()], 0.0)
    for sample in samples:
        if sample.name == PROMPT_TOKENS:
            key = "prompt_tokens"
        elif sample.name in wanted:
            key = wanted[sample.name]
        else:
            name = sample.name.removeprefix(PREFIX).removesuffix("_total")
            if name not in BY_LABEL or not sample.name.startswith(PREFIX):
                continue
            key = f"{name}.{sample.labels.get(BY_LABEL[name], '')}"
        found[key] = found.get(key, 0.0) + sample.value
    return found


def difference(later: Mapping[str, float], earlier: Mapping[str, float]) -> dict[str, float]:
    """What each count gained between two samples (a label value first seen in ``later`` gained all of it)."""
    return {key: value - earlier.get(key, 0.0) for key, value in later.items()}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _labelled(counts: Mapping[str, float], name: str) -> dict[str, int]:
    return {key.split(".", 1)[1]: int(value) for key, value in sorted(counts.items()) if key.startswith(f"{name}.")}


def figures(counts: Mapping[str, float]) -> dict[str, Any]:
    """The figures shown for one sample's (or one interval's) counts: hit rate is hit tokens over vLLM's prompt
    tokens (docs/observability.md), None without prompt tokens; speeds and means None without a load or store."""
    loads, stores = counts["load_seconds_count"], counts["store_seconds_count"]
    failed = _labelled(counts, "loads_failed")
    return {
        "prompt_tokens": int(counts["prompt_tokens"]),
        "hit_tokens": int(counts["hit_tokens"]),
        "hit_rate": _ratio(counts["hit_tokens"], counts["prompt_tokens"]),
        "lookups": int(counts["lookups"]),
        "bytes_loaded": int(counts["bytes_loaded"]),
        "chunks_loaded": int(counts["chunks_loaded"]),
        "bytes_stored": int(counts["bytes_stored"]),
        "chunks_stored": int(counts["chunks_stored"]),
        "loads": int(loads),
        "load_seconds": counts["load_seconds_sum"],
        "load_ms_mean": _ratio(1000 * counts["load_seconds_sum"], loads),
        "load_bytes_per_s": _ratio(counts["bytes_loaded"], counts["load_seconds_sum"]),
        "stores": int(stores),
        "store_seconds": counts["store_seconds_sum"],
        "store_ms_mean": _ratio(1000 * counts["store_seconds_sum"], stores),
        "loads_failed": sum(failed.values()),
        "loads_failed_by_cause": failed,
        "tier_bytes_read": _labelled(counts, "tier_bytes_read"),
    }


def _flat(figs: Mapping[str, Any]) -> dict[str, Any]:
    """One table line per figure: a per-cause or per-tier figure as ``name: label value``."""
    flat: dict[str, Any] = {}
    for key, value in figs.items():
        if isinstance(value, dict):
            flat.update({f"{key}: {label}": count for label, count in value.items()})
        else:
            flat[key] = value
    return flat


def table(result: Mapping[str, Any]) -> str:
    """The figures one a line, a column since start and one for the interval where taken."""
    columns = {"since start": _flat(result["since_start"])}
    if "interval" in result:
        columns[f"last {result['interval_seconds']:.1f} s"] = _flat(result["interval"])
    return "\n".join([f"{result['url']}: LMCache connector, summed over engines and models", fields_table(columns)])


def _check_seconds(option: str, value: float | None) -> None:
    if value is not None and not 0 < value < math.inf:
        raise StatsError(f"{option} must be a number of seconds above 0, got {value:g}")


def stats(url: str, interval_s: float | None, timeout_s: float) -> dict[str, Any]:
    """The result ``--json`` prints: since start from the last sample, and the interval's difference."""
    _check_seconds("--interval", interval_s)
    _check_seconds("--timeout", timeout_s)
    url = metrics_url(url)
    first = totals(fetch(url, timeout_s), url)
    first_at = time.monotonic()
    if interval_s is None:
        return {"url": url, "since_start": figures(first)}
    time.sleep(interval_s)
    last = totals(fetch(url, timeout_s), url)
    return {"url": url, "since_start": figures(last), "interval_seconds": round(time.monotonic() - first_at, 3),
            "interval": figures(difference(last, first))}


def run(args: argparse.Namespace) -> int:
    try:
        result = stats(args.url, args.interval, args.timeout)
    except StatsError as exc:
        print(f"lmcache-platforms stats: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else table(result))
    return 0
