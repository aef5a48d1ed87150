"""``make device-check``: on a GPU machine, the kernel contract suite and the Triton backend's speed, as JSON.

Runs ``pytest tests/layout tests/kernels`` and the GPU tests (the Triton kernel on the GPU against the torch
oracle, ``tests/kernels/test_triton_gpu.py``; the connector's path through pinned host memory,
``tests/connector/test_binding_gpu.py``) and ``lmcache-platforms bench --backend triton --json`` on the shipped
layouts (store and load against a same-size copy on the device, and the whole path to and from pinned host
memory against a pinned copy each way; on CUDA the GPU time alone, from CUDA graph replays, against a device
copy replayed the same way), and prints one JSON object on stdout (pytest's own report goes to
stderr). Exit 0 only when a GPU is present, no test failed, the GPU tests ran rather than skipped, and every
bench ran with the chunks' checksum made on the device (``bench_problems`` lists what is missing); CI has no
GPU, so this is what a user with one runs. ``--runs N`` benches each layout N times in turn and adds each
figure's range over them (``bench_ranges``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ("tests/kernels/test_triton_gpu.py", "tests/connector/test_binding_gpu.py")
SUITE = ("tests/layout", "tests/kernels", GPU_TESTS[1])
LAYOUTS = ("llama8b", "deepseek-v4", "gemma3")


class Outcomes:
    """pytest plugin collecting each test's outcome (a failure in set-up or tear-down counts as failed)."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.skipped: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.append(report.nodeid)
        elif report.skipped:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped[report.nodeid] = str(reason).removeprefix("Skipped: ")
        elif report.when == "call":
            self.passed.append(report.nodeid)


def gpu_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    return "xpu" if xpu is not None and xpu.is_available() else None


def run_suite() -> dict[str, Any]:
    outcomes = Outcomes()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON report alone
        code = pytest.main(["-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}", *(str(ROOT / p) for p in SUITE)],
                           plugins=[outcomes])
    gpu_ran = {path: sum(n.startswith(path) for n in outcomes.passed) for path in GPU_TESTS}
    return {"exit_code": int(code), "passed": len(outcomes.passed), "gpu_tests_passed": gpu_ran,
            "failed": outcomes.failed, "skipped": outcomes.skipped}


def run_bench(layout: str, device: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "lmcache_platforms.cli.main", "bench", "--layout", layout,
               "--backend", "triton", "--device", device, "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"exit_code": done.returncode, "error": done.stderr.strip()[-2000:]}
    return json.loads(lines[-1])


def ranges(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each numeric field of a layout's bench runs as [lowest, highest] (a failed run counts for nothing): the
    figures the README quotes, as a range over the runs of one session."""
    ran = [run for run in runs if "error" not in run]
    out: dict[str, list[float]] = {}
    for field in dict.fromkeys(field for run in ran for field in run):
        values = [run[field] for run in ran if isinstance(run.get(field), (int, float))
                  and not isinstance(run.get(field), bool)]
        if values:
            out[field] = [min(values), max(values)]
    return out


def bench_problems(bench: dict[str, dict[str, Any]], device: str) -> list[str]:
    """What is missing from each layout's bench: it failed, moved nothing to the host, lacks the GPU time alone
    (CUDA), or ran without the device's checksum (the binding's self-check of the CRC kernel failed, so every
    checksum was made on the host: the warning is in the bench's stderr)."""
    problems = []
    for layout, result in bench.items():
        if "error" in result:
            problems.append(f"{layout}: bench failed: {result['error'][-300:]}")
            continue
        if not result.get("store_to_host_GBps"):
            problems.append(f"{layout}: no store to pinned host memory was timed")
        if device == "cuda" and not result.get("gpu_store_x_device_copy"):
            problems.append(f"{layout}: no GPU time alone (CUDA graph replay)")
        if result.get("load_from_host_device_checksum_cost") is None:
            problems.append(f"{layout}: the device did not hash the chunks (the host did)")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of layouts to bench")
    parser.add_argument("--runs", type=int, default=1,
                        help="bench each layout this many times, in turn; the report's bench_ranges holds each "
                             "figure's lowest and highest (default 1)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    device = gpu_device()
    if device is None:
        print(json.dumps({"error": "no CUDA or XPU device: device-check runs on a GPU machine"}))
        return 2
    suite = run_suite()
    layouts = args.layouts.split(",")
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in layouts}
    for _ in range(args.runs):  # layouts in turn, so a drift of the machine touches each alike
        for layout in layouts:
            runs[layout].append(run_bench(layout, device))
    bench = {layout: results[0] for layout, results in runs.items()}
    problems = bench_problems({f"{layout} (run {index + 1})": result for layout, results in runs.items()
                               for index, result in enumerate(results)}, device)
    ok = (suite["exit_code"] == 0 and not suite["failed"] and all(suite["gpu_tests_passed"].values())
          and not any(n.startswith(GPU_TESTS) for n in suite["skipped"]) and not problems)
    report = {"ok": ok, "device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else device,
              "torch": torch.__version__, "suite": suite, "bench": bench, "bench_problems": problems,
              "bench_ranges": {layout: ranges(results) for layout, results in runs.items()}}
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
