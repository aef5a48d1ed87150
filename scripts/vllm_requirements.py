"""Print an installed distribution's runtime requirements minus torch and its media companions.

vLLM's CPU build is installed with --no-deps because it names torchvision/torchaudio/torchcodec, of which no
CPU build exists here; its other requirements are installed from this list, constrained to the CPU torch.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}


def runtime_requirements(dist: str) -> list[str]:
    out = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in SKIPPED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(runtime_requirements(sys.argv[1])))
