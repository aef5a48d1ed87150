"""Builds the Ascend C transfer kernel (this folder) into ``lmcache_platforms/kernels/_ascend_transfer*.so``.

Only where CANN is installed (``ASCEND_HOME_PATH`` or ``ASCEND_TOOLKIT_HOME``, set by CANN's ``set_env.sh``)
together with torch_npu and cmake; anywhere else it is skipped with one line saying what is missing, and the
NPU falls back to the ``torch`` kernel backend. A failed build never fails the package install either.
setup.py calls ``build_for_setup(build_ext_command)``; ``python csrc/ascend/build.py [TARGET]`` builds by hand.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARY_MODULE = "lmcache_platforms.kernels._ascend_transfer"
CANN_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
ASCENDC_CMAKE_DIRS = ("tools/tikcpp/ascendc_kernel_cmake", "compiler/tikcpp/ascendc_kernel_cmake",
                      "ascendc_devkit/tikcpp/samples/cmake")
SOC_HINT = "set SOC_VERSION to the chip (ascend910b1 for Atlas A2, ascend910_9391 for A3, ascend310p1 for 300I)"


@dataclass(frozen=True)
class BuildResult:
    built: bool
    message: str
    library: Path | None = None


def find_cann(env: Mapping[str, str]) -> Path | None:
    """The CANN toolkit root named by the environment, if it exists."""
    for name in CANN_VARIABLES:
        value = env.get(name)
        if value and Path(value).is_dir():
            return Path(value)
    return None


def ascendc_cmake_dir(cann: Path) -> Path | None:
    """Where this CANN version keeps ``ascendc.cmake`` (it moved between releases)."""
    return next((cann / d for d in ASCENDC_CMAKE_DIRS if (cann / d / "ascendc.cmake").is_file()), None)


def missing_prerequisite(env: Mapping[str, str]) -> str | None:
    """Why the kernel cannot be built here, or None when everything it needs is present."""
    cann = find_cann(env)
    if cann is None:
        return f"CANN not found ({' / '.join(CANN_VARIABLES)} unset or not a folder)"
    if ascendc_cmake_dir(cann) is None:
        return f"CANN at {cann} has no ascendc.cmake under {', '.join(ASCENDC_CMAKE_DIRS)}"
    if not env.get("SOC_VERSION"):
        return f"SOC_VERSION is not set: {SOC_HINT}"
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    if shutil.which("cmake", path=env.get("PATH")) is None:
        return "cmake is not on PATH"
    return None


def cmake_configure_command(build_dir: Path, env: Mapping[str, str], output_name: str) -> list[str]:
    """The cmake configure line for this folder, with torch / torch_npu locations read from Python."""
    import torch

    torch_npu_spec = importlib.util.find_spec("torch_npu")
    torch_npu_path = Path(torch_npu_spec.origin).parent
    return [
        "cmake", "-S", str(HERE), "-B", str(build_dir),
        f"-DASCEND_HOME_PATH={find_cann(env)}",
        f"-DSOC_VERSION={env['SOC_VERSION']}",
        f"-DTORCH_NPU_PATH={torch_npu_path}",
        f"-DTorch_DIR={Path(torch.utils.cmake_prefix_path) / 'Torch'}",
        f"-DGLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f"-DOUTPUT_NAME={output_name}",
        "-DCMAKE_BUILD_TYPE=Release",
    ]


def build(target: Path, env: Mapping[str, str] | None = None, build_dir: Path | None = None) -> BuildResult:
    """Build into ``target`` (a file path), or say why not; never raises for a missing toolchain."""
    env = dict(os.environ if env is None else env)
    reason = missing_prerequisite(env)
    if reason:
        return BuildResult(False, f"Ascend C kernels not built: {reason}; NPUs use the torch kernel backend")
    build_dir = build_dir or HERE / "build"
    commands = [cmake_configure_command(build_dir, env, target.name),
                ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 1)]]
    for command in commands:
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
            return BuildResult(False, "Ascend C kernels failed to build (`" + " ".join(command[:2]) + " ...`):\n"
                               + "\n".join(tail))
    produced = build_dir / target.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(produced, target)
    return BuildResult(True, f"Ascend C kernels built for {env['SOC_VERSION']}: {target}", target)


def build_for_setup(command) -> BuildResult:
    """setup.py hook: build next to the other extensions of a ``build_ext`` command (in place for -e)."""
    result = build(Path(command.get_ext_fullpath(LIBRARY_MODULE)))
    print(f"lmcache_platforms: {result.message}", file=sys.stderr)
    return result


if __name__ == "__main__":
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    default = HERE.parents[1] / "lmcache_platforms" / "kernels" / f"_ascend_transfer{suffix}"
    outcome = build(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
    print(outcome.message, file=sys.stderr)
    sys.exit(0 if outcome.built else 1)
