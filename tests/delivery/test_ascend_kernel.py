"""The Ascend kernel's delivery on a machine without CANN or an NPU: the build skips with the missing piece
named, the backend reports why it is unavailable and refuses transfers it cannot do, and the C++ sources
agree with the Python side on the table layout, op names and ABI (they cannot be compiled here)."""

from __future__ import annotations

import importlib.util
import re
import stat
import sys

import pytest
import torch

from lmcache_platforms.kernels import ascend_backend
from lmcache_platforms.kernels.contract import Direction, TransferError
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.delivery.pins import REPO

ASCEND = REPO / "csrc" / "ascend"


def load_build_module():
    spec = importlib.util.spec_from_file_location("ascend_build", ASCEND / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


BUILD = load_build_module()


@pytest.fixture(autouse=True)
def fresh_op_lookup():
    ascend_backend.load_op.cache_clear()
    yield
    ascend_backend.load_op.cache_clear()


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """An importable, empty ``torch_npu`` package (what the build and the backend look up first)."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    sys.modules.pop("torch_npu", None)


@pytest.fixture
def fake_cann(tmp_path):
    root = tmp_path / "cann"
    (root / "compiler" / "tikcpp" / "ascendc_kernel_cmake").mkdir(parents=True)
    (root / "compiler" / "tikcpp" / "ascendc_kernel_cmake" / "ascendc.cmake").write_text("")
    return root


def plane(geometry: PlaneGeometry, name: str = "k") -> Plane:
    t = torch.zeros(geometry.span_bytes, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return Plane("model.layers.0.self_attn", name, 0, torch.float16, geometry, 0, storage)


NZ = PlaneGeometry(num_blocks=4, block_stride=4 * 16 * 128 * 2, rows_per_block=128, row_stride=32,
                   segments=4, segment_bytes=32, segment_stride=128 * 32)
NHD_ODD = PlaneGeometry(num_blocks=4, block_stride=16 * 24, rows_per_block=16, row_stride=24,
                        segments=1, segment_bytes=24, segment_stride=24)


# --- backend -----------------------------------------------------------------------------------------------

def test_unavailable_without_torch_npu():
    assert ascend_backend.BACKEND.availability() == (False, "torch_npu is not installed")
    assert ascend_backend.BACKEND.name == "ascend"


def test_unavailable_when_the_kernel_was_not_built(fake_torch_npu):
    ok, reason = ascend_backend.BACKEND.availability()
    assert not ok
    assert reason.startswith("lmcache_platforms.kernels._ascend_transfer was not built; build it where CANN")


def test_cpu_planes_are_refused_with_the_reason():
    planes = [plane(NZ)]
    assert ascend_backend.BACKEND.unsupported(planes) == (
        "planes on ['cpu'], the ascend backend moves NPU memory only")
    slots = torch.tensor([0, -1, 5], dtype=torch.int64)
    buffer = torch.zeros(3 * NZ.row_bytes, dtype=torch.uint8)
    with pytest.raises(TransferError, match=r"moves NPU memory only"):
        ascend_backend.BACKEND.transfer(planes, slots, buffer, Direction.STORE)
    assert not buffer.any()


def test_310p_alignment_check_names_the_plane_and_field():
    assert ascend_backend.misaligned([plane(NZ)], 32) is None
    assert ascend_backend.misaligned([plane(NHD_ODD, "v")], 32) == (
        "plane 'v' of layer 'model.layers.0.self_attn': row_stride 24 is not a multiple of 32 bytes, "
        "which this chip's Ascend kernel needs")
    # the second plane's rows start after the first's in the buffer: that offset must be aligned too
    odd_rows = PlaneGeometry(4, 2048, 16, 128, 1, 96 + 8, 104)
    assert ascend_backend.misaligned([plane(NZ), plane(odd_rows, "v")], 8) is None
    message = ascend_backend.misaligned([plane(odd_rows, "k"), plane(NZ, "v")], 32)
    assert message.startswith("plane 'k' of layer 'model.layers.0.self_attn': segment_bytes 104")


# --- build ---------------------------------------------------------------------------------------------------

def test_build_skips_without_cann(tmp_path):
    target = tmp_path / "out" / "_ascend_transfer.so"
    result = BUILD.build(target, env={"PATH": "/usr/bin"})
    assert not result.built and result.library is None
    assert result.message == ("Ascend C kernels not built: CANN not found (ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME "
                              "unset or not a folder); NPUs use the torch kernel backend")
    assert not target.exists()


def test_build_names_each_missing_prerequisite(tmp_path, fake_cann):
    bare = tmp_path / "bare_cann"
    bare.mkdir()
    assert BUILD.missing_prerequisite({"ASCEND_HOME_PATH": str(bare)}).startswith(
        f"CANN at {bare} has no ascendc.cmake")
    env = {"ASCEND_TOOLKIT_HOME": str(fake_cann)}
    assert BUILD.missing_prerequisite(env) == f"SOC_VERSION is not set: {BUILD.SOC_HINT}"
    env["SOC_VERSION"] = "ascend910b1"
    assert BUILD.missing_prerequisite(env) == "torch_npu is not installed"


def test_build_runs_cmake_with_cann_torch_and_soc(tmp_path, fake_cann, fake_torch_npu):
    """A stand-in cmake records its arguments and fails like a compiler error would; the build reports it
    (with the tail of the output) instead of failing the install."""
    tools = tmp_path / "bin"
    tools.mkdir()
    log = tmp_path / "cmake.log"
    cmake = tools / "cmake"
    cmake.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "kv_transfer_kernel.cpp:1: error: boom" >&2\nexit 1\n')
    cmake.chmod(cmake.stat().st_mode | stat.S_IEXEC)
    env = {"ASCEND_HOME_PATH": str(fake_cann), "SOC_VERSION": "ascend310p1", "PATH": f"{tools}:/usr/bin:/bin"}
    assert BUILD.missing_prerequisite(env) is None
    result = BUILD.build(tmp_path / "_ascend_transfer.so", env=env, build_dir=tmp_path / "build")
    assert not result.built
    assert result.message.startswith("Ascend C kernels failed to build (`cmake -S ...`):")
    assert result.message.endswith("kv_transfer_kernel.cpp:1: error: boom")
    args = log.read_text().split()
    assert args[:4] == ["-S", str(ASCEND), "-B", str(tmp_path / "build")]
    assert f"-DASCEND_HOME_PATH={fake_cann}" in args
    assert "-DSOC_VERSION=ascend310p1" in args
    assert f"-DTORCH_NPU_PATH={fake_torch_npu}" in args
    assert "-DOUTPUT_NAME=_ascend_transfer.so" in args


# --- sources agree with the Python side --------------------------------------------------------------------

def test_sources_agree_with_plane_table_op_names_and_abi():
    kernel = (ASCEND / "kv_transfer_kernel.cpp").read_text()
    binding = (ASCEND / "torch_binding.cpp").read_text()
    # The table's layout and ABI version come from the one generated header (tests/kernels/
    # test_plane_table_schema.py ties it to kernels/plane_table.py).
    for source in (kernel, binding):
        assert '#include "../lmcp_plane_table.h"' in source
    assert "LMCP_PLANE_FIELDS" in kernel
    assert f"TORCH_LIBRARY({ascend_backend.OP_NAMESPACE}, m)" in binding
    assert "return LMCP_ABI_VERSION;" in binding

    def launch_signature(source: str) -> str:
        match = re.search(r'extern "C" void lmcp_kv_transfer_launch\(([^)]*)\)', source)
        return " ".join(match.group(1).split())

    assert launch_signature(kernel) == launch_signature(binding)
    cmake = (ASCEND / "CMakeLists.txt").read_text()
    assert "kv_transfer_kernel.cpp" in cmake and "torch_binding.cpp" in cmake
