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
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmcache_platforms.tools.demo import runners
from lmcache_platforms.tools.demo.runners import GroupLeader
from lmcache_platforms.tools.redis_server import RedisServer
from tests.fuzz import plants
from tests.fuzz.cases import DIMENSIONS, RECURRENT, RESUMES_OTHERWISE, WINDOW, Case, allowed_hits, draw_case
from tests.integration.vllm_env import fp8_cache_refusal

ENGINE_TIMEOUT_S = 900
# Top-logit difference allowed where a request computes in other shapes than the reference's, in bf16 units in
# the last place (the logits are bf16 values): one or two roundings apart. The largest a clean campaign saw is in
# docs/architecture.md (Tests); a poisoned or stale row moves them further.
DRIFT_ULPS = 2.0


@dataclass
class Verdict:
    case: Case
    problems: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


def model_dirs(cache: Path | None = None, names: tuple[str, ...] = tuple(DIMENSIONS["model"])) -> dict[str, str]:
    """The random-weight models by name, written once: a Gemma-3-style hybrid (4 of 6 layers slide over
    ``WINDOW`` tokens), a dense one of the same shape, and the recurrent hybrids of the recurrent tests."""
    from lmcache_platforms.tools.demo.model import TINY_MODEL, default_cache_dir, ensure_model
    from tests.integration.recurrent_model import ensure_tiny

    hybrid = replace(TINY_MODEL, name=f"fuzz-gemma-6L-w{WINDOW}", num_layers=6, sliding_window=WINDOW,
                     full_attention_every=3, max_model_len=2048)
    made = {"hybrid": lambda: ensure_model(hybrid, cache),
            "dense": lambda: ensure_model(replace(hybrid, name="fuzz-gemma-6L-dense", full_attention_every=1), cache)}
    for name in RECURRENT:
        made[name] = lambda name=name: ensure_tiny(name, (cache or default_cache_dir()) / f"fuzz-{name}")
    return {name: str(made[name]()) for name in names}


@functools.cache
def resume_rounds_otherwise() -> bool:
    """Whether vLLM's CPU attention rounds a prefill resumed after cached blocks otherwise than a cold one here:
    everywhere but its AMX path (bf16, blocks of 32s). Measured on its ``vec`` path (x86 without AVX-512):
    requests resumed after 384 and 768 tokens moved a top logit by one bf16 unit, and vLLM's own prefix cache,
    on the same core, answered them with the very same bytes as our loads."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, 128, 64, "auto") != "amx"


def resumed_bound(model: str) -> float:
    """The drift a resumed request may show: the model's own (``RESUMES_OTHERWISE``), plus ``DRIFT_ULPS`` where
    the attention resumes otherwise too (LFM2 on vLLM's ``vec`` path: 6 units seen, the same with unpoisoned
    blocks and in a consumer that loaded every chunk from Redis)."""
    own = RESUMES_OTHERWISE.get(model)
    if own is None:
        return DRIFT_ULPS
    return own + DRIFT_ULPS if resume_rounds_otherwise() else own


def pages_only() -> bool:
    """Whether vLLM's CPU attention keeps bf16 caches in AMX tiles here (rows then move only in whole blocks)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def _engine(spec: dict[str, Any], folder: Path, name: str, core: int) -> GroupLeader:
    """An engine pass on ``core`` with one thread, started as the tools start theirs (under the test suite: a
    child of a fork server that imported vLLM once)."""
    (folder / f"{name}.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONHASHSEED": "0",
           "LMCACHE_TRACK_USAGE": "false"}
    command = [sys.executable, "-m", "tests.fuzz.engine", str(folder / f"{name}.json"), str(folder / f"{name}.out")]
    return runners.launch(command, env, folder / f"{name}.log", runners.Resources((core,)))


def _finish(proc: GroupLeader, folder: Path, name: str) -> dict[str, Any] | str:
    try:
        rc = proc.wait(ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        runners.kill_group(proc)
        return f"{name} engine timed out after {ENGINE_TIMEOUT_S} s"
    out = folder / f"{name}.out"
    if rc != 0 or not out.exists():
        tail = (folder / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
        return f"{name} engine exited {rc}:\n    " + "\n    ".join(tail)
    return json.loads(out.read_text())


def _first_difference(ref: dict[str, Any], got: dict[str, Any]) -> str | None:
    """Where two answers part: their greedy tokens, else their top logprobs (bit for bit)."""
    if ref["tokens"] != got["tokens"]:
        step = next((i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"], strict=False)) if a != b), None)
        if step is None:
            return f"{len(got['tokens'])} tokens answered, the reference {len(ref['tokens'])}"
        return f"token {step} differs"
    if ref["logprobs"] != got["logprobs"]:
        step = next(i for i, (a, b) in enumerate(zip(ref["logprobs"], got["logprobs"], strict=True)) if a != b)
        return f"top logprobs differ from token {step}"
    return None


def _ulps(a: float, b: float) -> float:
    """|a - b| in units of the last place of a bf16 number as large as the larger of the two (the model computes
    its logits in bf16: two roundings of one value differ by whole such units)."""
    magnitude = max(abs(a), abs(b), 2.0**-6)
    return abs(a - b) / 2.0 ** (math.floor(math.log2(magnitude)) - 7)


def _drift(ref: dict[str, Any], got: dict[str, Any], bound: float) -> tuple[float, str | None]:
    """The first generated token's largest top-logit difference (in bf16 units in the last place), and a problem
    if it exceeds ``bound`` (the token whose logits read every row a load wrote), or if the answers choose
    different tokens where the reference's choice was no tie within the difference that step shows (later steps
    compound the first's rounding, so their bound is what they drifted)."""
    first = 0.0
    if len(got["tokens"]) != len(ref["tokens"]):
        return first, f"{len(got['tokens'])} tokens answered, the reference {len(ref['tokens'])}"
    for step, (want, have, a, b) in enumerate(zip(ref["tokens"], got["tokens"], ref["logprobs"], got["logprobs"],
                                                  strict=True)):
        theirs, ours = dict(map(tuple, a)), dict(map(tuple, b))
        drift = max((_ulps(theirs[t], ours[t]) for t in theirs.keys() & ours.keys()), default=math.inf)
        if step == 0:
            first = drift
            if drift > bound:
                return first, f"first token's top logits drift {drift:.2f} bf16 units"
        if want != have:
            gap = _ulps(theirs[want], theirs[have]) if have in theirs else math.inf
            if gap > max(bound, drift):
                return first, f"token {step} differs ({gap:.2f} bf16 units from a tie, {drift:.2f} drift)"
            return first, None
    return first, None


def compare(case: Case, reference: dict[str, Any], run: dict[str, Any], prestored: bool = False) -> list[str]:
    """Every difference between the two passes and every hit the stored chunks do not allow.

    A request computed in the same shapes as the reference's must match it bit for bit. Two kinds cannot: a
    batch of several requests with a hit (a load changes how many tokens the step computes, and vLLM's CPU
    kernels round a batch of another shape otherwise), and a hit that leaves one token to compute (vLLM's CPU
    attention then takes its one-query path, which rounds otherwise than a prefill: vLLM's own prefix cache
    differs from a cold run there too), and so does any hit on a model whose recurrent state vLLM resumes in
    other arithmetic than a prefill (``RESUMES_OTHERWISE``: vLLM's own prefix cache differs there too), and any
    hit on a CPU whose attention resumes a prefill in other arithmetic (``resume_rounds_otherwise``). Those
    are held to ``DRIFT_ULPS``, or the model's own bound.
    """
    problems = []
    expect_hma = case.settings["hma"]
    if run["hma"] != expect_hma:
        problems.append(f"vLLM's hybrid manager is {'on' if run['hma'] else 'off'}, expected the opposite")
    if run.get("pinned"):
        problems.append(f"{run['pinned']} objects still pinned in LMCache's CPU tier after the pass")
    case.waiting_aborts += run.get("aborted_waiting", 0)
    allowed = allowed_hits(case, prestored, run.get("chunk_size"))
    exact = case.settings["tier"] == "cpu" and not case.settings["prefix_caching"] and not case.recurrent
    index = 0
    for number, batch in enumerate(case.batches):
        counts = run["answers"][index + len(batch) - 1]["batch_hits"]
        hit = counts["lmcache"]
        case.hit_tokens += hit
        case.preemptions += counts.get("preemptions", 0)
        one_token = len(batch) == 1 and hit + counts["vllm"] == len(batch[0]) - 1
        otherwise = case.settings["model"] in RESUMES_OTHERWISE or resume_rounds_otherwise()
        resumed = otherwise and hit + counts["vllm"] > 0
        shaped_otherwise = (len(batch) > 1 and hit > 0) or one_token or resumed
        bound = resumed_bound(case.settings["model"]) if resumed else DRIFT_ULPS
        case.one_token += one_token
        case.incomparable += len(batch) if len(batch) > 1 and hit else 0
        for position in range(len(batch)):
            ref, got = reference["answers"][index], run["answers"][index]
            index += 1
            if case.client_aborts(number) and position == len(batch) - 1:
                continue  # aborted by its client on both sides: no answer
            if shaped_otherwise:
                drift, problem = _drift(ref, got, bound)
                case.drift = max(case.drift, drift)
            else:
                problem = _first_difference(ref, got)
            if problem:
                problems.append(f"request {index - 1} (batch {number}): {problem}")
        spans = allowed[index - len(batch):index]
        if None not in spans:
            low, high = (sum(ends) for ends in zip(*spans, strict=True))  # type: ignore[misc]
            if hit > high:
                problems.append(f"batch {number}: LMCache hit {hit} tokens, the stored chunks allow {high}")
            elif exact and not prestored and hit < low:
                problems.append(f"batch {number}: LMCache hit {hit} tokens, the stored chunks hold {low}")
        if reference["answers"][index - 1]["batch_hits"]["lmcache"]:
            problems.append(f"batch {number}: the reference, which stored nothing, hit LMCache")
    return problems


Result = dict[str, Any] | str  # an engine pass's answers, or why it has none


def run_passes(cases: list[Case], model_dir: str) -> tuple[Result, list[dict[str, Result]], Path]:
    """The reference pass of ``cases[0]`` (all cases share its settings and workload) and each case's passes
    (``case``, or ``producer`` then ``consumer`` on one store), two engines at a time, each on a core of its own;
    every pass group on the Redis tier gets a Redis server of its own."""
    folder = Path(tempfile.mkdtemp(prefix=f"fuzz-{cases[0].seed}-"))
    with ExitStack() as servers:
        def store(name: str) -> str | None:
            if cases[0].settings["tier"] != "redis":
                return None
            (folder / f"{name}-redis").mkdir()
            return servers.enter_context(RedisServer(str(folder / f"{name}-redis"))).url

        first = [("reference", cases[0].spec(model_dir, True, str(folder / "reference"),
                                             redis_url=store("reference")))]
        second = []
        for i, case in enumerate(cases):
            url, workdir = store(f"case{i}"), str(folder / f"case{i}")
            if case.settings["roles"] == "split":
                first.append((f"case{i}.producer", case.spec(model_dir, False, workdir, "kv_producer", url)))
                second.append((f"case{i}.consumer", case.spec(model_dir, False, workdir, "kv_consumer", url)))
            else:
                first.append((f"case{i}.case", case.spec(model_dir, False, workdir, redis_url=url)))
        results: dict[str, Result] = {}
        for jobs in (first, second):
            for start in range(0, len(jobs), 2):
                running = []
                for core, (name, spec) in enumerate(jobs[start:start + 2]):
                    (folder / name).mkdir()
                    running.append((name, _engine(spec, folder / name, name, core)))
                for name, proc in running:
                    results[name] = _finish(proc, folder / name, name)
    passes = [{k.split(".", 1)[1]: v for k, v in results.items() if k.startswith(f"case{i}.")}
              for i in range(len(cases))]
    return results["reference"], passes, folder


def judge(case: Case, reference: Result, passes: dict[str, Result]) -> list[str]:
    """Each pass of the case against the reference: a consumer may hit every chunk its producer stored."""
    failed = [f"{name}: {r}" if name != "case" else r for name, r in [("reference", reference), *passes.items()]
              if isinstance(r, str)]
    if failed:
        return failed
    problems = []
    for name, result in passes.items():
        found = compare(case, reference, result, prestored=name == "consumer")  # type: ignore[arg-type]
        problems += found if name == "case" else [f"{name}: {p}" for p in found]
    return problems


def run_case(case: Case, models: dict[str, str]) -> Verdict:
    started = time.perf_counter()
    reference, (passes,), folder = run_passes([case], models[case.settings["model"]])
    problems = judge(case, reference, passes)
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
    fp8_cache = fp8_cache_refusal() is None
    verdicts: list[Verdict] = []
    started = time.perf_counter()
    for seed in seeds:
        if stop(sum(v.case.requests for v in verdicts), time.perf_counter() - started):
            break
        case = draw_case(seed, amx, requests_per_case, fixed, fp8_cache)
        case.plant, case.poison = plant, poison
        verdict = run_case(case, models)
        verdicts.append(verdict)
        status = "ok" if verdict.ok else "FAIL"
        say(f"seed {seed}: {status} {case.requests} requests ({case.hit_tokens} tokens hit, "
            f"{case.preemptions} preemptions, {case.waiting_aborts} aborted waiting, drift {case.drift:.2f}) in "
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
    drift = max((v.case.drift for v in verdicts), default=0.0)
    preemptions = sum(v.case.preemptions for v in verdicts)
    waiting_aborts = sum(v.case.waiting_aborts for v in verdicts)
    reached: dict[str, set[str]] = defaultdict(set)
    for v in verdicts:
        for name, value in v.case.settings.items():
            reached[name].add(str(value))
    lines = [f"{len(verdicts)} cases, {requests} requests, {sum(not v.ok for v in verdicts)} failed, "
             f"{seconds / 60:.1f} minutes, {requests / max(seconds / 60, 1e-9):.1f} requests per minute; "
             f"{hits} tokens hit, {preemptions} preemptions, {waiting_aborts} requests aborted while waiting; "
             f"{incomparable} requests in concurrent batches with a hit and {one_token} with one token left to "
             f"compute held to a drift of {DRIFT_ULPS} bf16 units (largest seen {drift:.2f})"]
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


def _plant(value: str) -> str:
    """A ``--plant`` value: known faults joined by ``+``."""
    unknown = [part for part in value.split("+") if part not in plants.PLANTS]
    if unknown:
        known = ", ".join(sorted(plants.PLANTS))
        raise argparse.ArgumentTypeError(f"no such plant {', '.join(unknown)}; known: {known}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="first seed (then +1, +2...)")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    parser.add_argument("--minutes", type=float, default=None, help="stop starting cases after this long")
    parser.add_argument("--requests", type=int, default=None, help="stop once this many requests were served")
    parser.add_argument("--requests-per-case", type=int, default=12)
    parser.add_argument("--plant", type=_plant, default=None,
                        help=f"a fault to plant, or several joined by + (negative control: the fuzzer must fail): "
                             f"{', '.join(sorted(plants.PLANTS))}")
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
