"""AsyncLoads reports every load exactly once, as finished, and as failed too when it did not fully arrive;
a load past its deadline is failed and its late writes are refused; an error is a failed load, never an
exception out of the step."""

from __future__ import annotations

import threading
import time

import pytest

from lmcache_platforms.integration.vllm.async_loads import AsyncLoads, LoadGuard, LoadResults


def drain(loads: AsyncLoads, timeout: float = 10.0) -> LoadResults:
    """Poll like vLLM's steps until nothing is in flight; every report merged."""
    merged = LoadResults()
    deadline = time.monotonic() + timeout
    while loads.in_flight:
        assert time.monotonic() < deadline, "loads never reported"
        results = loads.poll()
        merged.finished |= results.finished
        merged.failed |= results.failed
        merged.causes.update(results.causes)
        time.sleep(0.005)
    return merged


@pytest.mark.parametrize("wait", [False, True], ids=["async", "sync"])
def test_outcomes_are_reported_once_failures_in_both_sets(wait: bool) -> None:
    loads = AsyncLoads(timeout_s=0)

    def boom(req_id: str, guard: LoadGuard) -> bool:
        raise OSError("redis went away")

    loads.submit("ok", lambda req_id, guard: True, wait=wait)
    loads.submit("short", lambda req_id, guard: False, wait=wait)
    loads.submit("raises", boom, wait=wait)
    if wait:
        assert loads.poll().finished == {"ok", "short", "raises"}  # the step waited: all ended already
        return
    results = drain(loads)
    assert (results.finished, results.failed) == ({"ok", "short", "raises"}, {"short", "raises"})
    assert results.causes == {"short": "missing", "raises": "error"}
    assert loads.poll() == LoadResults()
    loads.shutdown()


def test_a_second_load_of_the_same_request_in_flight_is_refused() -> None:
    release = threading.Event()
    loads = AsyncLoads(timeout_s=0)
    loads.submit("a", lambda req_id, guard: release.wait(5))
    with pytest.raises(RuntimeError, match=r"^request a: a load is already in flight$"):
        loads.submit("a", lambda req_id, guard: True)
    release.set()
    assert drain(loads).failed == set()
    loads.shutdown()


def test_a_load_past_its_deadline_is_failed_and_its_late_write_refused() -> None:
    loads = AsyncLoads(timeout_s=0.05)
    answer, tried = threading.Event(), threading.Event()
    writes: list[str] = []
    failures: list[str | None] = []

    def stuck(req_id: str, guard: LoadGuard) -> bool:
        answer.wait(5)  # a backend that answers long after the deadline
        guard.run(lambda: writes.append(req_id))
        failures.append(guard.failure)
        tried.set()
        return guard.failure is None

    loads.submit("slow", stuck)
    loads.submit("queued", lambda req_id, guard: True)  # behind the stuck one on the single loader thread
    results = drain(loads)
    assert (results.finished, results.failed) == ({"slow", "queued"}, {"slow", "queued"})
    assert results.causes == {"slow": "timeout", "queued": "timeout"}
    answer.set()
    assert tried.wait(5), "the late answer never came"
    # refused: vLLM may already recompute into those blocks
    assert (writes, failures) == ([], ["no answer within load_timeout_s=0.05"])
    loads.shutdown()


def test_a_waiting_step_is_released_at_the_deadline_and_a_started_load_gives_the_failure_value() -> None:
    loads = AsyncLoads(timeout_s=0.05)
    answer = threading.Event()
    started = time.monotonic()
    loads.submit("stuck", lambda req_id, guard: answer.wait(5), wait=True)
    assert time.monotonic() - started < 2
    assert loads.poll().causes == {"stuck": "timeout"}
    loads.fail("asleep")
    assert loads.poll().causes == {"asleep": "unregistered"}
    writes: list[int] = []

    def stuck_write(guard: LoadGuard) -> int | None:
        answer.wait(5)
        guard.run(lambda: writes.append(1))
        return None

    classic = loads.start("classic", stuck_write)
    assert (classic.result(on_failure=64), classic.guard.cause) == (64, "timeout")
    assert loads.start("fine", lambda guard: None).result(on_failure=64) == 64  # queued behind the stuck ones
    answer.set()
    assert loads.start("fine", lambda guard: None).result(on_failure=64) is None
    assert writes == []
    loads.shutdown()


def test_without_a_deadline_a_slow_load_is_waited_for() -> None:
    loads = AsyncLoads(timeout_s=0)
    loads.submit("slow", lambda req_id, guard: time.sleep(0.1) is None)
    assert loads.poll() == LoadResults()
    assert drain(loads).finished == {"slow"}
    loads.shutdown()


def test_guard_records_a_write_error_instead_of_raising_and_runs_good_writes() -> None:
    guard = LoadGuard("r")
    done: list[int] = []
    guard.run(lambda: done.append(1))
    assert (done, guard.failure) == ([1], None)

    def bad_kernel() -> None:
        raise ValueError("slot 7 out of range")

    guard.run(bad_kernel)
    assert guard.failure == "ValueError: slot 7 out of range"
    guard.cancel("deadline")
    guard.run(lambda: done.append(2))
    assert done == [1] and guard.failure == "deadline"


def test_fail_reports_without_running_and_shutdown_cancels_what_runs() -> None:
    loads = AsyncLoads(timeout_s=0)
    loads.fail("asleep")
    assert (loads.poll().failed, loads.in_flight) == ({"asleep"}, 0)
    started, release = threading.Event(), threading.Event()
    seen: list[LoadGuard] = []

    def running(req_id: str, guard: LoadGuard) -> bool:
        seen.append(guard)
        started.set()
        release.wait(5)
        return True

    loads.submit("running", running)
    assert started.wait(5)
    loads.shutdown()
    assert seen[0].cancelled == "connector shut down"
    release.set()
