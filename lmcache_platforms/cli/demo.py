"""vLLM's OpenAI-compatible server (`vllm serve`, CPU) serving a hybrid Gemma-3-style model (sliding-window + full
attention, several KV-cache groups) with LMCache through lmcache_platforms, driven by a streaming client: a
cold pass, then the same requests to a fresh server (warm), reporting LMCache hit tokens, TTFT as the client
saw it cold vs warm, and whether the outputs are identical. --compare adds vLLM with no connector and LMCache's
separate server mode on the same workload and cores."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lmcache_platforms.cli.workdir import run_in_workdir

if TYPE_CHECKING:
    from lmcache_platforms.tools.demo.scenario import DemoOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="end with one JSON summary line")
    parser.add_argument("--compare", action="store_true",
                        help="also run vLLM with no connector and LMCache's server mode (LMCacheMPConnector)")
    parser.add_argument("--size", choices=("demo", "tiny"), default="demo",
                        help="demo: 12 layers, 2,048-token prompts; tiny: a seconds-long smoke run")
    parser.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size (multiple of 32)")
    parser.add_argument("--cores", help="CPU ids every engine runs on, e.g. 0-1 or 0,2 (default: all usable)")
    parser.add_argument("--workdir", type=Path,
                        help="folder for logs and the LMCache store (default: a new temporary folder, removed "
                             "at the end unless --keep-workdir or the demo fails)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary folder (server logs)")
    parser.add_argument("--keep-store", action="store_true",
                        help="keep the LMCache store (WORKDIR/lmcache_store) after the run: a server started "
                             "with LMCACHE_CONFIG_FILE=WORKDIR/lmcache.yaml reads the chunks the demo stored")
    parser.add_argument("--model-cache", type=Path, help="where the random model is kept "
                        "(default: $LMCACHE_PLATFORMS_CACHE/models or ~/.cache/lmcache_platforms/models)")
    parser.add_argument("--pass-timeout", type=float, default=600.0, help="seconds one engine pass may take")


def _parse_cores(text: str) -> tuple[int, ...]:
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cores))


def _fail(message: str) -> int:
    print(f"lmcache-platforms demo: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import os

    from lmcache_platforms.tools.demo.runners import Resources
    from lmcache_platforms.tools.demo.scenario import DemoOptions

    if args.chunk_size <= 0 or args.chunk_size % 32:
        return _fail(f"--chunk-size must be a positive multiple of 32, got {args.chunk_size}")
    resources = Resources.available()
    if args.cores:
        try:
            cores = _parse_cores(args.cores)
        except ValueError:
            return _fail(f"--cores must look like 0-1 or 0,2, got {args.cores!r}")
        usable = set(os.sched_getaffinity(0))
        if not cores or not set(cores) <= usable:
            return _fail(f"--cores {args.cores} is not within the usable CPUs {sorted(usable)}")
        resources = Resources(cores)

    def progress(message: str) -> None:
        print(f"[demo] {message}", file=sys.stderr, flush=True)

    def body(workdir: Path) -> list[str]:
        progress(f"logs and LMCache store in {workdir}")
        options = DemoOptions(size=args.size, compare=args.compare, chunk_size=args.chunk_size, workdir=workdir,
                              cache_dir=args.model_cache, resources=resources, pass_timeout_s=args.pass_timeout,
                              keep_store=args.keep_store)
        return _run_and_report(options, progress, args.json)

    return run_in_workdir(args.workdir, args.keep_workdir, "lmcache_platforms_demo_", progress, body)


def _run_and_report(options: DemoOptions, progress: Callable[[str], None], as_json: bool) -> list[str]:
    """Run the demo, print its report; the problems found (empty when the demo showed what it should)."""
    from lmcache_platforms.tools.demo.report import problems, render, summary
    from lmcache_platforms.tools.demo.runners import PassFailed
    from lmcache_platforms.tools.demo.scenario import run_demo

    try:
        demo = run_demo(options, progress)
    except PassFailed as exc:
        print(f"lmcache-platforms demo: {exc}", file=sys.stderr)
        if as_json:
            print(json.dumps({"error": str(exc).splitlines()[0]}))
        return [str(exc)]
    print(render(demo))
    result = summary(demo)
    found = problems(result)
    for problem in found:
        print(f"lmcache-platforms demo: {problem}", file=sys.stderr)
    if as_json:
        print(json.dumps(result))
    return found
