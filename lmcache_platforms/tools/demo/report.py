"""The demo's tables and its one-line JSON summary, from a finished ``DemoRun``."""

from __future__ import annotations

from statistics import mean, median
from typing import Any

from lmcache_platforms.tools.demo.identity import Verdict, compare
from lmcache_platforms.tools.demo.scenario import DemoRun, Outcome

# How far a warm pass's top-k logits may move from the cold pass's. Reused KV is a bit-exact copy, but the warm
# prefill runs only the prompt's tail, in other shapes, so the last bits of a logit may differ; a bad load (a
# wrong, shifted or zeroed row) moves them by far more.
MAX_LOGIT_DRIFT_BF16_STEPS = 2.0


def _mean_ttft(result: dict[str, Any] | None) -> float | None:
    if not result:
        return None
    return mean(r["ttft_s"] for r in result["requests"])


def _median_ttft(result: dict[str, Any] | None) -> float | None:
    """The headline figure: a burst from another process on a shared CPU moves a mean, seldom a median."""
    if not result:
        return None
    return median(r["ttft_s"] for r in result["requests"])


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when a pass had no requests (or took no time)."""
    return numerator / denominator if numerator is not None and denominator else None


def _verdicts(outcome: Outcome) -> list[Verdict]:
    cold, warm = outcome.passes.get("cold"), outcome.passes.get("warm")
    if not cold or not warm:
        return []
    return [compare(c, w) for c, w in zip(cold["requests"], warm["requests"], strict=True)]


def expected_hit_tokens(prompt_tokens: int, chunk_size: int) -> int:
    """What a warm pass must load from LMCache for one prompt: every whole chunk, except that vLLM must compute
    at least the last token, so a prompt of whole chunks loads all but that token (upstream's rule)."""
    whole = prompt_tokens // chunk_size * chunk_size
    return whole if whole < prompt_tokens else prompt_tokens - 1


def summary(run: DemoRun) -> dict[str, Any]:
    """The JSON object the CLI prints last."""
    ours = run.outcomes["ours"]
    cold, warm = ours.passes["cold"], ours.passes["warm"]
    verdicts = _verdicts(ours)
    cold_ttft, warm_ttft = _median_ttft(cold), _median_ttft(warm)
    result: dict[str, Any] = {
        "model": run.model.name,
        "kv_groups": len(cold["kv_groups"]),
        "requests": len(run.requests),
        "prompt_tokens": sum(len(r.tokens) for r in run.requests),
        "chunk_size": run.options.chunk_size,
        "hit_tokens": sum(r["lmcache_hit_tokens"] for r in warm["requests"]),
        "expected_hit_tokens": sum(expected_hit_tokens(len(r.tokens), run.options.chunk_size)
                                   for r in run.requests),
        "hit_tokens_per_request": [r["lmcache_hit_tokens"] for r in warm["requests"]],
        "identical": all(v.identical for v in verdicts),
        "bf16_ties": sum(v.tie for v in verdicts),
        "different": sum(not v.equivalent for v in verdicts),
        "max_logit_drift_bf16_steps": max((v.max_logit_steps for v in verdicts), default=0.0),
        "ttft_cold_s": cold_ttft,
        "ttft_warm_s": warm_ttft,
        "warm_over_cold": _ratio(warm_ttft, cold_ttft),
        "ttft_cold_mean_s": _mean_ttft(cold),
        "ttft_warm_mean_s": _mean_ttft(warm),
        "cores": list(run.options.resources.cores),
        "lmcache_degraded": any(m.lower() in w.lower() for p in (cold, warm) for w in p.get("warnings", [])
                                for m in ("degraded mode", "remote connection")),
        "clean_exit": not any("hung at exit" in w for o in run.outcomes.values() for p in o.passes.values()
                              for w in p.get("warnings", [])),
    }
    if run.options.compare:
        none, server = run.outcomes.get("none"), run.outcomes.get("server")
        result["ttft_no_connector_s"] = _median_ttft(none.passes.get("cold")) if none else None
        server_warm = _median_ttft(server.passes.get("warm")) if server else None
        result["ttft_warm_lmcache_server_s"] = server_warm
        result["lmcache_server_error"] = server.error.splitlines()[0] if server and server.error else None
        result["warm_over_lmcache_server"] = _ratio(warm_ttft, server_warm)
        reference = _against_no_connector(run)
        result["identical_to_no_connector"] = all(v.identical for v in reference) if reference else None
        result["different_from_no_connector"] = sum(not v.equivalent for v in reference) if reference else None
        result["no_connector_verdicts"] = [v.describe() for v in reference]
    return result


def _against_no_connector(run: DemoRun) -> list[Verdict]:
    """Our warm pass against vLLM without a connector: the answer a user would have got anyway."""
    none, warm = run.outcomes.get("none"), run.outcomes["ours"].passes.get("warm")
    reference = none.passes.get("cold") if none else None
    if not reference or not warm:
        return []
    return [compare(r, w) for r, w in zip(reference["requests"], warm["requests"], strict=True)]


def problems(summary_: dict[str, Any]) -> list[str]:
    """Why the demo did not show what it should (hits, >= 2 groups, no output differing beyond a bf16 tie)."""
    found = []
    if summary_["hit_tokens"] == 0:
        found.append("the warm pass got no LMCache hits" + (" (LMCache ran in degraded mode, see the warning)"
                                                              if summary_["lmcache_degraded"] else ""))
    elif summary_["hit_tokens"] != summary_["expected_hit_tokens"]:
        found.append(f"the warm pass loaded {summary_['hit_tokens']} tokens from LMCache, expected exactly "
                     f"{summary_['expected_hit_tokens']} (every whole chunk of every prompt)")
    elif summary_["lmcache_degraded"]:
        found.append("LMCache ran in degraded mode in a pass (see the warning)")
    if summary_["max_logit_drift_bf16_steps"] > MAX_LOGIT_DRIFT_BF16_STEPS:
        found.append(f"warm top-k logits drifted {summary_['max_logit_drift_bf16_steps']:.1f} bf16 steps from "
                     f"cold (allowed: {MAX_LOGIT_DRIFT_BF16_STEPS})")
    if not summary_["clean_exit"]:
        found.append("a pass did not shut down cleanly (see the warning)")
    if summary_.get("different_from_no_connector"):
        found.append(f"{summary_['different_from_no_connector']} request(s) of our warm pass produced different "
                     "tokens from vLLM without a connector (beyond a bf16 tie)")
    if summary_["kv_groups"] < 2:
        found.append(f"vLLM made {summary_['kv_groups']} KV-cache group(s); the demo needs a hybrid layout")
    if summary_["different"]:
        found.append(f"{summary_['different']} request(s) produced different tokens warm than cold")
    return found


def _fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.3f} {unit}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return out


def render(run: DemoRun) -> str:
    """Human-readable report: groups, per-request cold vs warm, and the comparison table if any."""
    ours = run.outcomes["ours"]
    cold, warm = ours.passes["cold"], ours.passes["warm"]
    groups = ", ".join(f"{g['spec'] or 'group'}(block {g['block_size']})" for g in cold["kv_groups"])
    lines = [
        f"model {run.model.name}: {run.model.num_layers} layers, {len(cold['kv_groups'])} KV-cache groups: "
        f"{groups}",
        f"LMCache chunk size {run.options.chunk_size}, vLLM block size {cold['kv_groups'][0]['block_size']}, "
        f"cores {','.join(map(str, run.options.resources.cores))}",
        "",
    ]
    rows = []
    for c, w, verdict in zip(cold["requests"], warm["requests"], _verdicts(ours), strict=True):
        rows.append([
            c["name"], str(c["prompt_tokens"]), _fmt(c["ttft_s"]), _fmt(w["ttft_s"]),
            f"{w['lmcache_hit_tokens']}", f"{w['vllm_hit_tokens']}", verdict.describe(),
        ])
    lines += _table(["request", "prompt", "TTFT cold", "TTFT warm", "LMCache hits (warm)",
                     "vLLM prefix hits (warm)", "warm output vs cold"], rows)
    for warning in sorted({w for result in (cold, warm) for w in result.get("warnings", [])}):
        lines.append(f"WARNING from the engine log: {warning}")
    cold_median, warm_median = _median_ttft(cold), _median_ttft(warm)
    ratio = _ratio(warm_median, cold_median)
    lines += ["", f"median TTFT as the client saw it: cold {_fmt(cold_median)}, warm (fresh server) {_fmt(warm_median)}"
              f" = {'-' if ratio is None else f'{ratio:.3f}x'} cold   (means: cold {_fmt(_mean_ttft(cold))}, "
              f"warm {_fmt(_mean_ttft(warm))})"]
    if run.options.compare:
        lines += ["", *_comparison(run)]
    return "\n".join(lines)


def _comparison(run: DemoRun) -> list[str]:
    rows = []
    for key in ("none", "server", "ours"):
        outcome = run.outcomes.get(key)
        if outcome is None:
            continue
        cold, warm = outcome.passes.get("cold"), outcome.passes.get("warm")
        if outcome.error and not cold:
            rows.append([outcome.label, "-", "-", "-", "could not run: " + outcome.error.splitlines()[0]])
            continue
        hits = sum(r["lmcache_hit_tokens"] for r in warm["requests"]) if warm else 0
        if key == "none":
            note = "nothing is kept across servers: warm = cold"
        else:
            note = outcome.error.splitlines()[0] if outcome.error else ""
        rows.append([outcome.label, _fmt(_median_ttft(cold)), _fmt(_median_ttft(warm)), str(hits), note])
    return _table(["configuration", "median client TTFT cold", "median client TTFT warm (fresh server)",
                   "hit tokens (warm)", "note"], rows)
