"""A stand-in for an engine pass, to test process handling without vLLM: ``spec['behaviour']`` picks
what it does: write a result, fail with an error, write a result and hang, or start a grandchild and hang."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    Path(spec["progress_file"]).write_text("step one\nstep two\n")
    behaviour = spec["behaviour"]
    if behaviour == "ok":
        Path(argv[1]).write_text(json.dumps({"requests": []}))
        print("LMCache ERROR: LMCache is in DEGRADED MODE for the worker (test)")
        return 0
    if behaviour == "hang_at_exit":
        Path(argv[1]).write_text(json.dumps({"requests": []}))
        time.sleep(600)
    if behaviour == "fail":
        raise ValueError("Connector X does not support HMA but HMA is enabled.")
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
