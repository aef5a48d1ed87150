"""Hit tokens and time to first token, cold vs warm, for the tiny random Qwen3-Next through our connector.

``.venv/bin/python scripts/bench_recurrent.py [--tokens N] [--budgets 0,512] [--repeats R]`` (run from the
repository root; 0 is vLLM's default budget). Per budget: a cold engine runs a warm-up prompt, then the measured
prompt (stored to a fresh ``fs://`` store); a fresh warm engine runs the warm-up prompt, then the measured prompt
again (loaded). Time to first token is the wall time of a 1-token ``generate``; the median over ``--repeats``
engine pairs is printed with the hit tokens of the warm request. A benchmark, not a test: not in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.recurrent_model import ensure_tiny_qwen3_next  # noqa: E402


def one_pass(model: Path, store: Path, job: dict) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.recurrent_run", str(model), str(store),
                           "connector"], input=json.dumps(job), capture_output=True, text=True, env=env, cwd=REPO,
                          check=False)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--budgets", default="0,512")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model = ensure_tiny_qwen3_next(Path(work) / "model")
        prompt = [(i * 37) % 2000 + 1 for i in range(args.tokens)]
        warmup = [(i * 13) % 1800 + 3 for i in range(512)]
        print(f"tiny Qwen3-Next, {args.tokens}-token prompt, LMCache local CPU + fs://, median of {args.repeats}")
        print("budget   hit tokens   cold TTFT s   warm TTFT s   warm/cold")
        for budget in (int(b) for b in args.budgets.split(",")):
            job = {"prompts": [warmup, prompt], "max_tokens": 1, "budget": budget}
            cold, warm, hits = [], [], set()
            for repeat in range(args.repeats):
                store = Path(work) / f"store-{budget}-{repeat}"
                store.mkdir()
                cold.append(one_pass(model, store, job)["runs"][1]["seconds"])
                run = one_pass(model, store, job)["runs"][1]
                warm.append(run["seconds"])
                hits.add(run["cached"])
            c, w = statistics.median(cold), statistics.median(warm)
            name = str(budget) if budget else "default"
            print(f"{name:>7}   {'/'.join(map(str, sorted(hits))):>10}   {c:11.3f}   {w:11.3f}   {w / c:9.2f}")


if __name__ == "__main__":
    main()
