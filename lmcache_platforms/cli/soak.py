"""Soak: concurrent streaming clients against `vllm serve` with our connector (tiny hybrid demo model) for a bounded
time, on full hits, partial hits and misses, with an LMCache CPU budget small enough that eviction never stops.
Reports failed requests, hits, a sample compared with a server without a connector (and a planted difference
that must be caught), LMCache's pinned objects after the run and the worker's RSS; exit 1 on any problem."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmcache_platforms.cli.workdir import run_in_workdir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=300.0, help="seconds the clients send requests")
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=5000, help="at most this many requests in all")
    parser.add_argument("--cpu-budget-gb", type=float, default=0.004,
                        help="LMCache max_local_cpu_size (GB); a tiny-model chunk is 128 KiB")
    parser.add_argument("--sample", type=int, default=9, help="requests compared with a server without a connector")
    parser.add_argument("--json", action="store_true", help="end with one JSON summary line")
    parser.add_argument("--workdir", type=Path, help="folder for server logs (default: a temporary folder, removed "
                        "unless the run fails or --keep-workdir)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary folder (server logs)")
    parser.add_argument("--model-cache", type=Path, help="where the random model is kept")


def render(report: dict) -> str:
    rss, lmc = report["rss"], report["lmcache"]
    lines = [f"requests {report['requests']} in {report['elapsed_s']} s with {report['clients']} clients, "
             f"failed {report['failed']}, LMCache hit tokens {report['hit_tokens']}, "
             f"latency p50 {report['latency_p50_s']} s max {report['latency_max_s']} s"]
    for kind, counts in report["by_kind"].items():
        lines.append(f"  {kind:8s} {counts['requests']:5d} requests, {counts['hit_requests']} with a hit, "
                     f"{counts['all_reusable_hit']} hit every reusable chunk, {counts['hit_tokens']} hit tokens")
    lines.append(f"LMCache after the run: pinned {lmc['pinned']:.0f}, active {lmc['active']:.0f}, "
                 f"evictions {lmc['evictions']:.0f}, forced unpins {lmc['forced_unpins']:.0f}")
    for label, figures in (("worker RSS", rss), ("worker RSS without a connector", report["reference_rss"])):
        lines.append(f"{label} (pid {figures['pid']}): before {figures['before_run_mib']} MiB, start "
                     f"{figures['start_mib']} MiB, end {figures['end_mib']} MiB (growth {figures['growth_mib']} MiB), "
                     f"max {figures['max_mib']} MiB")
    if report["oracle"]:
        oracle = report["oracle"]
        lines.append(f"sample vs no connector: {oracle['compared']} compared, {len(oracle['differences'])} differ; "
                     f"planted difference caught: {oracle['control']['caught']} ({oracle['control']['verdict']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from lmcache_platforms.tools.demo.runners import PassFailed
    from lmcache_platforms.tools.soak import SoakOptions, run_soak

    if args.duration <= 0 or args.clients < 1 or args.requests < 1:
        print("lmcache-platforms soak: --duration, --clients and --requests must be positive", file=sys.stderr)
        return 2

    def progress(message: str) -> None:
        print(f"[soak] {message}", file=sys.stderr, flush=True)

    def body(workdir: Path) -> list[str]:
        options = SoakOptions(duration_s=args.duration, clients=args.clients, max_requests=args.requests,
                              cpu_budget_gb=args.cpu_budget_gb, sample=args.sample, workdir=workdir,
                              cache_dir=args.model_cache)
        progress(f"logs in {workdir}")
        try:
            report = run_soak(options, progress)
        except PassFailed as exc:
            print(f"lmcache-platforms soak: {exc}", file=sys.stderr)
            return [str(exc)]
        print(render(report))
        for problem in report["problems"]:
            print(f"lmcache-platforms soak: {problem}", file=sys.stderr)
        if args.json:
            print(json.dumps(report))
        return report["problems"]

    return run_in_workdir(args.workdir, args.keep_workdir, "lmcache_platforms_soak_", progress, body)
