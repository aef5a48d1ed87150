"""Summary figures and verdicts from pass results (plain data, as engine passes write them)."""

from __future__ import annotations

from pathlib import Path

from lmcache_platforms.tools.demo.model import TINY_MODEL
from lmcache_platforms.tools.demo.report import expected_hit_tokens, problems, render, summary
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.scenario import DemoOptions, DemoRun, Outcome
from lmcache_platforms.tools.demo.workload import TINY_WORKLOAD, build_workload

GROUPS = [{"spec": "SlidingWindowSpec", "block_size": 32}, {"spec": "FullAttentionSpec", "block_size": 32}]


def _request(name: str, ttft: float, hits: int, tokens: list[int]) -> dict:
    return {"name": name, "prompt_tokens": 300, "lmcache_hit_tokens": hits, "vllm_hit_tokens": 0,
            "ttft_s": ttft, "tokens": tokens, "top_logits": [[[t, 5.0]] for t in tokens]}


def _run(warm_tokens: list[int], warm_hits: int = 256, compare: bool = False) -> DemoRun:
    requests = build_workload(TINY_WORKLOAD, TINY_MODEL.vocab_size)
    options = DemoOptions(size="tiny", compare=compare, workdir=Path("."), resources=Resources((0,)))
    run = DemoRun(TINY_MODEL, TINY_WORKLOAD, requests, options)
    cold = [_request("a", 1.0, 0, [1, 2]), _request("b", 3.0, 0, [3, 4]), _request("c", 2.0, 0, [5, 6])]
    warm = [_request("a", 0.1, warm_hits, [1, 2]), _request("b", 0.3, warm_hits, [3, 4]),
            _request("c", 0.2, warm_hits, warm_tokens)]
    run.outcomes["ours"] = Outcome("ours", {"cold": {"kv_groups": GROUPS, "requests": cold},
                                            "warm": {"kv_groups": GROUPS, "requests": warm}})
    return run


def test_summary_uses_medians_and_counts_hits_and_groups() -> None:
    result = summary(_run([5, 6]))
    assert result["kv_groups"] == 2 and result["requests"] == 3
    assert result["hit_tokens"] == 768
    assert result["ttft_cold_s"] == 2.0 and result["ttft_warm_s"] == 0.2
    assert abs(result["warm_over_cold"] - 0.1) < 1e-12
    assert result["identical"] and result["different"] == 0
    assert result["clean_exit"] and not result["lmcache_degraded"]
    assert problems(result) == []
    assert ("median TTFT as the client saw it: cold 2.000 s, warm (fresh server) 0.200 s = 0.100x cold"
            in render(_run([5, 6])))


def test_different_tokens_and_missing_hits_are_problems() -> None:
    result = summary(_run([5, 7], warm_hits=0))
    assert not result["identical"] and result["different"] == 1
    assert problems(result) == ["the warm pass got no LMCache hits",
                                "1 request(s) produced different tokens warm than cold"]
    assert "DIFFERENT from token 1" in render(_run([5, 7], warm_hits=0))


def test_compare_reports_a_server_that_could_not_run() -> None:
    run = _run([5, 6], compare=True)
    run.outcomes["none"] = Outcome("vLLM, no connector", {"cold": run.outcomes["ours"].passes["cold"]})
    run.outcomes["server"] = Outcome("LMCache server mode", error="lmcache server did not start: X\nlog ...")
    result = summary(run)
    assert result["ttft_no_connector_s"] == 2.0
    assert result["ttft_warm_lmcache_server_s"] is None
    assert result["lmcache_server_error"] == "lmcache server did not start: X"
    assert "could not run: lmcache server did not start: X" in render(run)


def test_expected_hits_are_every_whole_chunk_but_never_the_last_token() -> None:
    assert [expected_hit_tokens(n, 64) for n in (63, 64, 65, 127, 128, 129, 264)] == [0, 63, 64, 64, 127, 128, 256]


def test_a_hit_count_off_by_one_chunk_is_a_problem() -> None:
    result = summary(_run([5, 6], warm_hits=192))
    assert result["expected_hit_tokens"] == 768 and result["hit_tokens"] == 576
    assert problems(result) == ["the warm pass loaded 576 tokens from LMCache, expected exactly 768 (every whole "
                                "chunk of every prompt)"]


def test_logit_drift_beyond_the_bound_is_a_problem_even_with_identical_tokens() -> None:
    run = _run([5, 6])
    warm = run.outcomes["ours"].passes["warm"]["requests"][2]
    warm["top_logits"] = [[[5, 5.0 + 3 * 0.03125]], [[6, 5.0]]]  # 3 bf16 steps at 5.0 (step 2**-5)
    result = summary(run)
    assert result["identical"] and result["max_logit_drift_bf16_steps"] == 3.0
    assert problems(result) == ["warm top-k logits drifted 3.0 bf16 steps from cold (allowed: 2.0)"]


def test_a_hung_or_degraded_pass_is_a_problem() -> None:
    run = _run([5, 6])
    run.outcomes["ours"].passes["warm"]["warnings"] = [
        "pass ours-warm: vllm serve did not stop within 60 s of SIGINT (hung at exit); it was killed",
        "LMCache entering degraded mode"]
    result = summary(run)
    assert not result["clean_exit"] and result["lmcache_degraded"]
    assert problems(result) == ["LMCache ran in degraded mode in a pass (see the warning)",
                                "a pass did not shut down cleanly (see the warning)"]


def test_answers_unlike_a_server_without_a_connector_are_a_problem() -> None:
    run = _run([5, 6], compare=True)
    reference = {"requests": [dict(r) for r in run.outcomes["ours"].passes["cold"]["requests"]]}
    reference["requests"][0] = {**reference["requests"][0], "tokens": [1, 9]}
    run.outcomes["none"] = Outcome("vLLM, no connector", {"cold": reference})
    result = summary(run)
    assert result["identical"] and result["identical_to_no_connector"] is False
    assert result["different_from_no_connector"] == 1
    assert result["no_connector_verdicts"] == ["DIFFERENT from token 1", "identical", "identical"]
    assert problems(result) == ["1 request(s) of our warm pass produced different tokens from vLLM without a "
                                "connector (beyond a bf16 tie)"]
