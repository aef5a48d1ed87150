"""The short soak: four streaming clients against ``vllm serve`` with our connector for 60 requests, on full
hits, partial hits and misses, with an LMCache CPU budget that keeps eviction running (``lmcache-platforms soak``
runs the long one). Nothing may fail, a sample must answer as a server without a connector (and a planted
difference must be caught, or that comparison proves nothing), LMCache's pins must be back to zero and the
worker's RSS must not grow more than the bound beyond what the worker of a server without a connector grows
under the same requests (vLLM's CPU worker grows by itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_platforms.tools.soak import SoakOptions, problems, run_soak

pytestmark = pytest.mark.slow

RSS_GROWTH_BOUND_MIB = 64.0
# Bounded by a request count, not by seconds: the requests are the same every run, so how many can hit does not
# depend on the machine's speed (in 12 s a busy CI machine sent 20-odd requests, whose few repeats were evicted
# or still in flight; the first 60 hold 34 full or partial requests whose prefix was sent six or more requests
# before). The deadline only bounds a hang.
REQUESTS = 60


def test_short_soak_fails_nothing_answers_as_without_a_connector_and_releases_every_pin(tmp_path: Path) -> None:
    options = SoakOptions(duration_s=240.0, clients=4, max_requests=REQUESTS, sample=9, workdir=tmp_path)
    report = run_soak(options, lambda _message: None)
    assert report["requests"] == REQUESTS and report["failed"] == 0, report["errors"]
    assert all(report["by_kind"][kind]["requests"] for kind in ("full", "partial", "miss")), report["by_kind"]
    assert report["by_kind"]["full"]["hit_requests"] and report["by_kind"]["partial"]["hit_requests"]
    assert report["lmcache"]["evictions"] > 0, "the CPU budget never made LMCache evict"
    oracle = report["oracle"]
    assert oracle["compared"] == options.sample and oracle["differences"] == [], oracle
    assert oracle["control"]["caught"], oracle["control"]
    assert report["lmcache"]["pinned"] == 0 and report["lmcache"]["forced_unpins"] == 0, report["lmcache"]
    extra = report["rss"]["growth_mib"] - report["reference_rss"]["growth_mib"]
    assert extra < RSS_GROWTH_BOUND_MIB, (report["rss"], report["reference_rss"])
    assert problems(report, RSS_GROWTH_BOUND_MIB) == []
    assert report["exit_codes"] == [0, 0]
    assert not Path(f"/proc/{report['rss']['pid']}").exists(), "the server's worker outlived it"
