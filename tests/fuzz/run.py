"""The differential fuzzer: random settings and workloads, every answer compared with a reference that stored
nothing, poisoned blocks on, every hit compared with what the stored chunks allow.

``python -m tests.fuzz.run --minutes 60`` (or ``--requests 2000``, ``--seed S --cases 1`` to replay a case);
``make fuzz`` runs it. Each case runs two fresh engines side by side, each bound to one core of its own with
one thread: the reference (same connector and settings, ``lmcache.skip_save`` on every request) and the case.
Prints one line per case, a summary (cases, requests, requests per minute, the settings reached) and, for a
failure, its seed and the one-line replay command; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tests.fuzz.cases import DIMENSIONS, WINDOW, Case, allowed_hits, draw_case

ENGINE_TIMEOUT_S = 900


@dataclass
class Verdict:
    case: Case
    problems: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


def model_dirs(cache: Path | None = None) -> dict[str, str]:
    """The two random-weight models: a Gemma-3-style hybrid (4 of 6 layers slide over ``WINDOW`` tokens) and a
    dense one of the same shape."""
    from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model

    hybrid = replace(TINY_MODEL, name=f"fuzz-gemma-6L-w{WINDOW}", num_layers=6, sliding_window=WINDOW,
                     full_attention_every=3, max_model_len=2048)
    dense = replace(hybrid, name="fuzz-gemma-6L-dense", full_attention_every=1)
    return {"hybrid": str(ensure_model(hybrid, cache)), "dense": str(ensure_model(dense, cache))}


def pages_only() -> bool:
    """Whether vLLM's CPU attention keeps bf16 caches in AMX tiles here (rows then move only in whole blocks)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def _engine(spec: dict[str, Any], folder: Path, name: str, core: int) -> subprocess.Popen[bytes]:
    (folder / f"{name}.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONHASHSEED": "0",
           "LMCACHE_TRACK_USAGE": "false"}
    with open(folder / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.engine", str(folder / f"{name}.json"), str(folder / f"{name}.out")],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])


def _finish(proc: subprocess.Popen[bytes], folder: Path, name: str) -> dict[str, Any] | str:
    try:
        rc = proc.wait(ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return f"{name} engine timed out after {ENGINE_TIMEOUT_S} s"
    out = folder / f"{name}.out"
    if rc != 0 or not out.exists():
        tail = (folder / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
        return f"{name} engine exited {rc}:\n    " + "\n    ".join(tail)
    return json.loads(out.read_text())


def compare(case: Case, reference: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Every difference between the two passes and every hit the stored chunks do not allow."""
    problems = []
    expect_hma = case.settings["hma"]
    if run["hma"] != expect_hma:
        problems.append(f"vLLM's hybrid manager is {'on' if run['hma'] else 'off'}, expected the opposite")
    allowed = allowed_hits(case)
    exact = case.settings["tier"] == "cpu" and not case.settings["prefix_caching"]
    index = 0
    for number, batch in enumerate(case.batches):
        counts = run["answers"][index + len(batch) - 1]["batch_hits"]
        hit = counts["lmcache"]
        case.hit_tokens += hit
        case.preemptions += counts.get("preemptions", 0)
        if len(batch) > 1 and hit:
            # A load changes how many tokens the step computes, and vLLM's CPU kernels round a batch of another
            # shape differently: only single requests, or batches without a hit, compare with the reference.
            case.incomparable += len(batch)
            index += len(batch)
            continue
        one_token = len(batch) == 1 and hit + counts["vllm"] == len(batch[0]) - 1
        case.one_token += one_token
        for _ in batch:
            ref, got = reference["answers"][index], run["answers"][index]
            if ref["tokens"] != got["tokens"]:
                step = next(i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"], strict=False)) if a != b)
                problems.append(f"request {index} (batch {number}): token {step} differs")
            elif ref["logprobs"] != got["logprobs"] and not one_token:
                # A hit that leaves one token to compute runs vLLM's CPU attention on its one-query path, which
                # rounds otherwise than a whole prefill: vLLM's own prefix cache differs from a cold run there
                # too. Such a request is held to its greedy tokens.
                step = next(i for i, (a, b) in enumerate(zip(ref["logprobs"], got["logprobs"], strict=True))
                            if a != b)
                problems.append(f"request {index} (batch {number}): top logprobs differ from token {step}")
            index += 1
        budget = [allowed[i] for i in range(index - len(batch), index)]
        if None not in budget:
            if hit > sum(budget):  # type: ignore[arg-type]
                problems.append(f"batch {number}: LMCache hit {hit} tokens, the stored chunks allow {budget}")
            elif exact and hit != sum(budget):  # type: ignore[arg-type]
                problems.append(f"batch {number}: LMCache hit {hit} tokens, the stored chunks hold {budget}")
        if reference["answers"][index - 1]["batch_hits"]["lmcache"]:
            problems.append(f"batch {number}: the reference, which stored nothing, hit LMCache")
    return problems


def run_passes(cases: list[Case], model_dir: str) -> tuple[dict[str, Any] | str, list[dict[str, Any] | str], Path]:
    """The reference pass of ``cases[0]`` (all cases share its settings and workload) and each case's pass, two
    engines at a time, each on a core of its own."""
    folder = Path(tempfile.mkdtemp(prefix=f"fuzz-{cases[0].seed}-"))
    jobs = [("reference", cases[0].spec(model_dir, True, str(folder / "reference")))]
    jobs += [(f"case{i}", c.spec(model_dir, False, str(folder / f"case{i}"))) for i, c in enumerate(cases)]
    results: dict[str, dict[str, Any] | str] = {}
    for start in range(0, len(jobs), 2):
        running = []
        for core, (name, spec) in enumerate(jobs[start:start + 2]):
            (folder / name).mkdir()
            running.append((name, _engine(spec, folder / name, name, core)))
        for name, proc in running:
            results[name] = _finish(proc, folder / name, name)
    return results["reference"], [results[f"case{i}"] for i in range(len(cases))], folder


def judge(case: Case, reference: dict[str, Any] | str, result: dict[str, Any] | str) -> list[str]:
    failed = [r for r in (reference, result) if isinstance(r, str)]
    return failed or compare(case, reference, result)  # type: ignore[arg-type]


def run_case(case: Case, models: dict[str, str]) -> Verdict:
    started = time.perf_counter()
    reference, (result,), folder = run_passes([case], models[case.settings["model"]])
    problems = judge(case, reference, result)
    if problems:
        case.notes.append(f"engine logs in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return Verdict(case, problems, time.perf_counter() - started)


def replay_command(case: Case) -> str:
    plant = f" --plant {case.plant}" if case.plant else ""
    poison = "" if case.poison else " --no-poison"
    fixed = "".join(f" --set {name}={value}" for name, value in case.fixed.items())
    return (f"python -m tests.fuzz.run --seed {case.seed} --cases 1 --requests-per-case {case.requests}"
            f"{plant}{poison}{fixed}")


def fuzz(seeds: list[int], requests_per_case: int, stop: Callable[[int, float], bool], plant: str | None = None,
         poison: bool = True, fixed: dict[str, Any] | None = None,
         say: Callable[[str], None] = print) -> list[Verdict]:
    models = model_dirs()
    amx = pages_only()
    verdicts: list[Verdict] = []
    started = time.perf_counter()
    for seed in seeds:
        if stop(sum(v.case.requests for v in verdicts), time.perf_counter() - started):
            break
        case = draw_case(seed, amx, requests_per_case, fixed)
        case.plant, case.poison = plant, poison
        verdict = run_case(case, models)
        verdicts.append(verdict)
        status = "ok" if verdict.ok else "FAIL"
        say(f"seed {seed}: {status} {case.requests} requests ({case.hit_tokens} tokens hit, "
            f"{case.preemptions} preemptions) in "
            f"{verdict.seconds:.0f} s {json.dumps(case.settings)}")
        for problem in verdict.problems:
            say(f"    {problem}")
        if not verdict.ok:
            say(f"    replay: {replay_command(case)}")
            for note in case.notes:
                say(f"    {note}")
    return verdicts


def summary(verdicts: list[Verdict], seconds: float) -> str:
    requests = sum(v.case.requests for v in verdicts)
    incomparable = sum(v.case.incomparable for v in verdicts)
    hits = sum(v.case.hit_tokens for v in verdicts)
    one_token = sum(v.case.one_token for v in verdicts)
    preemptions = sum(v.case.preemptions for v in verdicts)
    reached: dict[str, set[str]] = defaultdict(set)
    for v in verdicts:
        for name, value in v.case.settings.items():
            reached[name].add(str(value))
    lines = [f"{len(verdicts)} cases, {requests} requests, {sum(not v.ok for v in verdicts)} failed, "
             f"{seconds / 60:.1f} minutes, {requests / max(seconds / 60, 1e-9):.1f} requests per minute; "
             f"{hits} tokens hit, {preemptions} preemptions; "
             f"{incomparable} requests in concurrent batches with a hit not compared, {one_token} requests with "
             "one token left to compute held to their tokens only"]
    for name, values in DIMENSIONS.items():
        missing = {str(v) for v in values} - reached[name]
        lines.append(f"  {name}: {', '.join(sorted(reached[name]))}" + (f" (not reached: {', '.join(sorted(missing))})"
                                                                       if missing else ""))
    return "\n".join(lines)


def _setting(item: str) -> tuple[str, Any]:
    name, _, raw = item.partition("=")
    if name not in DIMENSIONS:
        raise SystemExit(f"--set {item}: unknown setting {name!r} (known: {', '.join(DIMENSIONS)})")
    by_text = {str(v): v for v in DIMENSIONS[name]}
    if raw not in by_text:
        raise SystemExit(f"--set {item}: {name} takes one of {', '.join(by_text)}")
    return name, by_text[raw]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="first seed (then +1, +2...)")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    parser.add_argument("--minutes", type=float, default=None, help="stop starting cases after this long")
    parser.add_argument("--requests", type=int, default=None, help="stop once this many requests were served")
    parser.add_argument("--requests-per-case", type=int, default=12)
    parser.add_argument("--plant", choices=["skip-row", "window-off-by-one"], default=None,
                        help="a fault to plant (negative control: the fuzzer must fail)")
    parser.add_argument("--no-poison", action="store_true", help="leave the blocks a load fills as they were")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help=f"fix one setting instead of drawing it ({', '.join(DIMENSIONS)})")
    args = parser.parse_args(argv)
    fixed = dict(_setting(item) for item in args.set)
    if args.cases is None and args.minutes is None and args.requests is None:
        args.cases = 1

    def stop(requests: int, seconds: float) -> bool:
        return ((args.requests is not None and requests >= args.requests)
                or (args.minutes is not None and seconds >= args.minutes * 60))

    count = args.cases if args.cases is not None else 1_000_000
    started = time.perf_counter()
    verdicts = fuzz(list(range(args.seed, args.seed + count)), args.requests_per_case, stop, args.plant,
                    not args.no_poison, fixed)
    print(summary(verdicts, time.perf_counter() - started))
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
