"""``lmcache-platforms selftest --backend faulty`` for several (layout, fault, row unit) cases in one process.

Each selftest builds and closes its own LMCacheEngine, and the faulty backend reads ``LMCACHE_PLATFORMS_FAULT`` at
every transfer, so one interpreter can run the cases in turn: the ~10 s of importing LMCache and our package are
paid once instead of once per case. Run as a script (``python -c``, the cases as JSON on stdin) where only
``PYTHONPATH`` brings the plugin; prints one JSON object mapping ``layout/fault/rows`` to
``[exit status, stdout, stderr]`` of the command.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def run_cases(cases: list[list[str]]) -> dict[str, list[object]]:
    from lmcache_platforms.cli.main import main

    results: dict[str, list[object]] = {}
    for layout, fault, rows in cases:
        os.environ["LMCACHE_PLATFORMS_FAULT"] = fault
        os.environ["LMCACHE_PLATFORMS_CHUNK_ROWS"] = rows
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["selftest", "--layout", layout, "--json", "--backend", "faulty"])
        results[f"{layout}/{fault}/{rows}"] = [code, out.getvalue(), err.getvalue()]
    return results


if __name__ == "__main__":
    print(json.dumps(run_cases(json.loads(sys.stdin.read()))))
