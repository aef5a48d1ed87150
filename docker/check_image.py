"""Build-time check of an image: pinned upstream versions installed, our plugins visible to vLLM and LMCache.

Run as ``python docker/check_image.py cuda|xpu|npu`` at the end of each Dockerfile so that a base image
that moved on (another vLLM, a missing torch-npu) fails the build instead of the first request.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

PINS = dict(
    line.split("=", 1)
    for line in (Path(__file__).with_name("versions.env")).read_text().splitlines()
    if line and not line.startswith("#")
)
SERVING = {"cuda": ("vllm", "VLLM_VERSION"), "xpu": ("vllm", "VLLM_VERSION"),
           "npu": ("vllm-ascend", "VLLM_ASCEND_VERSION")}
RUNTIME = {"cuda": None, "xpu": None, "npu": "torch-npu"}
DEVICE_PLUGIN = {"npu": "lmcache_platforms_npu"}  # LMCache's NPU ops otherwise need LMCache-Ascend
NATIVE_KERNEL = {"npu": "lmcache_platforms.kernels._ascend_transfer"}  # built by setup.py via csrc/ascend/build.py


def _release(text: str, parts: int) -> str:
    return ".".join(text.split("+")[0].split(".")[:parts])


def problems(platform: str) -> list[str]:
    found = []
    try:
        if version("lmcache") != PINS["LMCACHE_VERSION"]:
            found.append(f"lmcache {version('lmcache')} installed, images pin {PINS['LMCACHE_VERSION']}")
    except PackageNotFoundError:
        found.append("lmcache is not installed")
    dist, key = SERVING[platform]
    try:
        if _release(version(dist), 2) != _release(PINS[key], 2):
            found.append(f"{dist} {version(dist)} installed, this image is for {dist} {_release(PINS[key], 2)}.x")
    except PackageNotFoundError:
        found.append(f"{dist} is not installed")
    if RUNTIME[platform]:
        try:
            version(RUNTIME[platform])
        except PackageNotFoundError:
            found.append(f"{RUNTIME[platform]} is not installed")
    if platform in NATIVE_KERNEL and importlib.util.find_spec(NATIVE_KERNEL[platform]) is None:
        found.append(f"{NATIVE_KERNEL[platform]} was not built (see the set-up log: csrc/ascend/build.py)")
    if platform in DEVICE_PLUGIN:
        names = {e.name for e in entry_points(group="lmcache.device_plugins")}
        if DEVICE_PLUGIN[platform] not in names:
            found.append(f"the lmcache.device_plugins entry point {DEVICE_PLUGIN[platform]} is not installed")
    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    if not any(v.startswith("lmcache_platforms") for v in plugins):
        found.append("lmcache_platforms' vllm.general_plugins entry point is not installed")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SERVING:
        print(f"usage: check_image.py {'|'.join(SERVING)}", file=sys.stderr)
        sys.exit(2)
    bad = problems(sys.argv[1])
    for line in bad:
        print(f"image check failed: {line}", file=sys.stderr)
    if bad:
        sys.exit(1)
    print(f"image check passed: {sys.argv[1]} image, lmcache {PINS['LMCACHE_VERSION']}")
