"""The memory figures of an engine pass (``bench --engine``'s ``rss_growth_MiB``): the high-water mark after a
reset counts what was touched after it, and only that."""

from __future__ import annotations

import mmap

from lmcache_platforms.tools.demo.engine_pass import _memory_mib, _reset_peak

BLOCK_MIB = 64


def _touch_and_free() -> None:
    """Make ``BLOCK_MIB`` of new pages resident, then give them back. An anonymous mapping of its own: memory
    from an allocator (torch's, glibc's) may reuse pages a long-lived test worker already holds, which leave
    the resident size where it was (this test once failed in CI that way)."""
    with mmap.mmap(-1, BLOCK_MIB << 20) as block:
        for offset in range(0, len(block), mmap.PAGESIZE):
            block[offset] = 1
        assert block[len(block) - mmap.PAGESIZE] == 1


def test_the_peak_after_a_reset_counts_what_came_after_it() -> None:
    base = _memory_mib("VmRSS")
    _reset_peak()
    _touch_and_free()
    peak = _memory_mib("VmHWM")
    assert base is not None and peak is not None
    assert peak - base >= BLOCK_MIB * 0.95


def test_a_reset_forgets_the_peak_before_it() -> None:
    """The negative control of the reset: the same block touched and freed before it leaves no trace after."""
    _touch_and_free()
    base = _memory_mib("VmRSS")
    _reset_peak()
    peak = _memory_mib("VmHWM")
    assert base is not None and peak is not None
    assert peak - base < BLOCK_MIB / 4
