"""The connector statistics vLLM aggregates across workers and steps, and the recorder each side keeps."""

from __future__ import annotations

import pytest

from lmcache_platforms.integration.vllm.stats import MAX_TIMINGS, PlatformsConnectorStats, StatsRecorder


def test_aggregate_sums_counters_and_joins_timings() -> None:
    one = PlatformsConnectorStats({"bytes_loaded": 100, "chunks_loaded": 1, "load_seconds": [0.5]})
    two = PlatformsConnectorStats({"bytes_loaded": 28, "chunks_loaded": 2, "load_seconds": [0.25, 0.25]})
    total = one.aggregate(two)
    assert total.data["bytes_loaded"] == 128 and total.data["chunks_loaded"] == 3
    assert total.data["load_seconds"] == [0.5, 0.25, 0.25]
    reduced = total.reduce()
    assert reduced["load_ms_mean"] == 333.333 and reduced["store_ms_mean"] == 0.0
    assert reduced["bytes_loaded"] == 128 and reduced["loads_failed"] == 0


def test_a_recorder_gives_what_happened_since_the_last_take_and_nothing_when_idle() -> None:
    recorder = StatsRecorder()
    assert recorder.take() is None
    recorder.count("lookups")
    recorder.count("hit_tokens", 256)
    recorder.timing("store_seconds", 0.002)
    taken = recorder.take()
    assert taken is not None and not taken.is_empty()
    assert (taken.data["lookups"], taken.data["hit_tokens"], taken.data["store_seconds"]) == (1, 256, [0.002])
    assert recorder.take() is None


@pytest.mark.parametrize("record", [
    lambda r: r.count("lookups"), lambda r: r.advance("remote_lookups_timed_out", 3),
    lambda r: r.count_labelled("group_bytes_loaded", {0: 2}), lambda r: r.failed_load("missing"),
    lambda r: r.timing("load_seconds", 0.001)], ids=["count", "advance", "labelled", "failed", "timing"])
def test_every_kind_of_record_is_taken_at_the_next_step(record) -> None:
    """An idle take returns at once (vLLM takes stats every step); each way of recording makes the next take
    hold it. An advance that gained nothing, or labels that counted nothing, record nothing."""
    recorder = StatsRecorder()
    recorder.advance("remote_lookups_timed_out", 0)
    recorder.count_labelled("group_bytes_loaded", {0: 0})
    assert recorder.take() is None
    record(recorder)
    taken = recorder.take()
    assert taken is not None and not taken.is_empty()
    assert recorder.take() is None


def test_timings_nobody_takes_stay_bounded() -> None:
    """vLLM's LMCacheConnectorV1 runs our impl but never takes its stats."""
    recorder = StatsRecorder()
    for i in range(MAX_TIMINGS + 10):
        recorder.timing("load_seconds", float(i))
    taken = recorder.take()
    assert taken is not None and len(taken.data["load_seconds"]) == MAX_TIMINGS
    assert taken.data["load_seconds"][0] == 10.0


def test_an_empty_stats_object_is_empty_and_reset_empties() -> None:
    assert PlatformsConnectorStats().is_empty()
    stats = PlatformsConnectorStats({"loads_failed": 1})
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty()


def test_failed_loads_are_counted_by_cause_and_summed_across_workers() -> None:
    recorder = StatsRecorder()
    recorder.failed_load("corrupt")
    recorder.failed_load("timeout")
    recorder.failed_load("timeout")
    one = recorder.take()
    assert one is not None
    assert (one.data["loads_failed"], one.data["failed_corrupt"], one.data["failed_timeout"]) == (3, 1, 2)
    other = StatsRecorder()
    other.failed_load("corrupt")
    total = one.aggregate(other.take())  # type: ignore[arg-type]
    assert {name: value for name, value in total.reduce().items() if "failed" in name} == {
        "loads_failed": 4, "failed_corrupt": 2, "failed_timeout": 2}
    assert recorder.take() is None
    assert (recorder.totals["loads_failed"], recorder.totals["failed_timeout"]) == (3, 2)  # never taken


def test_an_unknown_cause_is_refused_and_counts_nothing() -> None:
    recorder = StatsRecorder()
    with pytest.raises(ValueError, match="unknown failed-load cause 'evicted'; known: missing, corrupt, timeout"):
        recorder.failed_load("evicted")
    assert recorder.take() is None


def test_a_running_count_kept_elsewhere_is_counted_once_as_it_grows() -> None:
    recorder = StatsRecorder()
    recorder.advance("remote_lookups_skipped", 3)
    recorder.advance("remote_lookups_skipped", 3)
    taken = recorder.take()
    assert taken is not None and taken.data["remote_lookups_skipped"] == 3
    recorder.advance("remote_lookups_skipped", 5)
    taken = recorder.take()
    assert taken is not None and taken.data["remote_lookups_skipped"] == 2
    recorder.advance("remote_lookups_skipped", 5)
    assert recorder.take() is None
    assert recorder.totals["remote_lookups_skipped"] == 5


def test_bytes_per_kv_group_are_summed_group_by_group_across_workers_and_steps() -> None:
    recorder = StatsRecorder()
    recorder.count_labelled("group_bytes_stored", {0: 100, 1: 0})
    recorder.count_labelled("group_bytes_stored", {0: 28, 3: 7})
    taken = recorder.take()
    assert taken is not None and not taken.is_empty()
    assert (taken.data["group_bytes_stored"], taken.data["group_bytes_loaded"]) == ({"0": 128, "3": 7}, {})
    other = PlatformsConnectorStats({"group_bytes_stored": {"3": 1, "1": 2}, "group_bytes_loaded": {"0": 5}})
    total = taken.aggregate(other)
    assert total.data["group_bytes_stored"] == {"0": 128, "3": 8, "1": 2}
    assert total.data["group_bytes_loaded"] == {"0": 5}
    assert recorder.take() is None
    assert not PlatformsConnectorStats({"group_bytes_loaded": {"0": 1}}).is_empty()
