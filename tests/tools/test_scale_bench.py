"""The scale-out bench's workload and table (``bench --servers``): which server answers which prefix when,
and the row it reports. Running servers is the bench itself (minutes), outside the suite."""

from __future__ import annotations

from typing import Any

from lmcache_platforms.tools.demo.model import TINY_MODEL, with_context
from lmcache_platforms.tools.scale_bench import SUFFIX_TOKENS, Ask, percentile, prompt, schedule, summary


def test_one_server_answers_everything_and_has_seen_every_prefix_after_round_0() -> None:
    plan = schedule(2, 3, 1)
    assert plan == [[Ask(r, 0, g, r > 0) for g in range(2)] for r in range(3)]


def test_three_servers_get_each_prefix_first_on_another_server_every_round() -> None:
    plan = schedule(6, 3, 3)
    assert [[(a.server, a.seen) for a in asks] for asks in plan] == [
        [(g % 3, False) for g in range(6)],
        [((g + 1) % 3, False) for g in range(6)],
        [((g + 2) % 3, False) for g in range(6)],
    ]


def test_with_two_servers_round_2_returns_each_prefix_to_the_server_of_round_0() -> None:
    plan = schedule(4, 3, 2)
    assert [a.seen for a in plan[1]] == [False] * 4
    assert [(a.server, a.seen) for a in plan[2]] == [(g % 2, True) for g in range(4)]


def test_prompts_share_exactly_their_groups_prefix() -> None:
    vocab = TINY_MODEL.vocab_size
    first, again, other = prompt(0, 0, 512, vocab), prompt(0, 1, 512, vocab), prompt(1, 0, 512, vocab)
    assert len(first) == 512 + SUFFIX_TOKENS
    assert first[:512] == again[:512] and first[512] != again[512]
    assert first[0] != other[0]


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 0.99) == 3.0


def answer(cached: int, ttft: float) -> dict[str, Any]:
    return {"cached_tokens": cached, "ttft_s": ttft}


def test_the_row_counts_warm_rounds_only_and_cross_server_hits_where_the_prefix_was_new() -> None:
    answered = [
        (Ask(0, 0, 0, False), answer(0, 9.0)),  # round 0: computed, not in the row
        (Ask(1, 1, 0, False), answer(256, 0.1)),  # another server's stores
        (Ask(1, 0, 1, True), answer(224, 0.3)),  # its own prefix cache (or LMCache: not counted as cross)
        (Ask(2, 1, 1, False), None),  # failed
    ]
    row = summary(2, answered, 0.5, 300)
    assert row == {"servers": 2, "warm_requests": 2, "errors": 1, "requests_per_s": 4.0, "ttft_p50_s": 0.2,
                   "ttft_p99_s": 0.3, "hit_rate": 480 / 600, "cross_server_hit_rate": 256 / 600}



def test_a_context_too_short_for_the_tokens_grows_to_the_next_power_of_two() -> None:
    assert with_context(TINY_MODEL, 1024) is TINY_MODEL  # fits exactly
    longer = with_context(TINY_MODEL, 1025)
    assert longer.max_model_len == 2048 and longer.name == f"{TINY_MODEL.name}-ctx2048"
