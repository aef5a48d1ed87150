"""Build of lmcache_platforms: the package, and the native CPU transfer library when a C compiler is present."""

from __future__ import annotations

import runpy
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

LMCACHE_PIN = "lmcache==0.5.6"


class OptionalBuildExt(build_ext):
    """Builds native kernels if it can; without a compiler the package still installs and uses `torch`."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "no native kernels", not "no package"
            print(f"lmcache_platforms: native CPU kernels not built ({exc}); the torch backend will be used",
                  file=sys.stderr)
        runpy.run_path("csrc/ascend/build.py")["build_for_setup"](self)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - same reason as above, per extension
            print(f"lmcache_platforms: {ext.name} not built ({exc}); falling back to the torch backend",
                  file=sys.stderr)


cpu_kernels = Extension(
    "lmcache_platforms.kernels._cpu_transfer",
    sources=["csrc/cpu/kv_transfer.c", "csrc/cpu/crc32c.c"],
    depends=["csrc/lmcp_plane_table.h", "csrc/cpu/crc32c.h"],
    extra_compile_args=["-O3", "-std=c11", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(
    name="lmcache_platforms",
    version="0.1.0",
    description="Hybrid-model (multi KV-group) LMCache offloading for vLLM on CPU, CUDA, XPU and Ascend NPU",
    python_requires=">=3.11",
    packages=find_packages(include=["lmcache_platforms", "lmcache_platforms.*"]),
    # LMCache's device-plugin entry point; outside the package so LMCache's discovery never imports the package.
    py_modules=["lmcache_platforms_npu_device"],
    package_data={"lmcache_platforms": ["examples/*.json"]},
    ext_modules=[cpu_kernels],
    cmdclass={"build_ext": OptionalBuildExt},
    install_requires=[
        "torch>=2.4",
        LMCACHE_PIN,
        "wrapt>=1.14",
        "packaging",
        "psutil",
    ],
    extras_require={
        # import-linter pinned: `lint-imports` enforces the layer contracts in pyproject.toml (make test, make lint); mypy type-checks the package
        "test": ["pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "ruff", "redis", "import-linter==2.16", "mypy==2.4.1"],
        "triton": ["triton"],
    },
    entry_points={
        "console_scripts": ["lmcache-platforms = lmcache_platforms.cli.main:main"],
        "vllm.general_plugins": ["lmcache_platforms = lmcache_platforms.activation:vllm_plugin"],
        "lmcache.device_plugins": [
            "lmcache_platforms_npu = lmcache_platforms_npu_device:PlatformsNpuDeviceSpec",
        ],
    },
)
