"""The Triton transfer kernel compiled ahead of time for real GPUs, no GPU needed: Triton's own NVIDIA back end
(LLVM to PTX, then its bundled ptxas to a cubin) for sm_80, sm_90 and sm_100, and its AMD back end (LLVM to
AMDGCN, then its bundled linker to an hsaco) for gfx942 (MI300), for every unit width and both directions.

The interpreter tests prove what the kernel computes; these prove it compiles for those GPUs, and what it
emits there: every payload access moves exactly the unit the backend chose, under the row's mask. The kernel
reads plane addresses from a run-time table, so the compiler cannot prove 16-byte alignment and emits one
access per unit (no ``ld.global.v4``); threads next to each other touch units next to each other, so a warp's
accesses still coalesce. The module compiles into an empty cache folder, so every case really compiles.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_platforms.kernels import triton_backend
from lmcache_platforms.kernels.contract import Direction
from tests.ci import missing

CUDA_TARGETS = {80: "sm_80", 90: "sm_90a", 100: "sm_100a"}
AMD_ARCH = "gfx942"
BLOCK = triton_backend.TritonBackend.block
# The signature the JIT builds for a launch: int64 table and slots, the byte view of the buffer, sizes that fit
# 32 bits, and the tensors' 16-byte alignment (PyTorch's allocations) as divisibility hints.
SIGNATURE = {"table_ptr": "*i64", "slots_ptr": "*i64", "slots_chunk_stride": "i32", "slots_plane_stride": "i32",
             "num_rows": "i32", "buffer_ptr": "*u8", "buffer_chunk_stride": "i32"}
ALIGNED = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (5,): [["tt.divisibility", 16]]}
TABLE_LOADS = 9  # eight plane-table fields and the row's slot, each one 64-bit load per thread
AMD_LOAD = {1: "ubyte", 2: "ushort", 4: "dword", 8: "dwordx2"}
AMD_STORE = {1: "byte", 2: "short", 4: "dword", 8: "dwordx2"}
PTX_ACCESS = re.compile(r"^\s*(@%p\d+\s+)?(ld|st)\.global\.(\S+)\s", re.MULTILINE)
AMD_ACCESS = re.compile(r"^\s*global_(load|store)_(\w+)\s", re.MULTILINE)


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Triton with a fresh, empty kernel cache for this module, and the transfer kernel built for the compiler: an
    earlier test of the same worker may have left it built for the interpreter (``TRITON_INTERPRET``)."""
    try:
        import triton as module
    except ImportError as exc:
        missing(f"triton is not installed ({exc})")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        patch.delenv("TRITON_INTERPRET", raising=False)
        triton_backend._kernel.cache_clear()
        yield module
        triton_backend._kernel.cache_clear()


def backend_or_missing(triton: Any, name: str) -> None:
    from triton.backends import backends

    if name not in backends:
        missing(f"this triton {triton.__version__} ships no {name!r} compiler back end (has {sorted(backends)})")


def compile_transfer(triton: Any, target: Any, unit: int, direction: Direction) -> Any:
    from triton.compiler import ASTSource

    kernel, _ = triton_backend._kernel()
    constants = triton_backend.launch_constants(unit, direction, BLOCK)
    signature = {**SIGNATURE, **dict.fromkeys(constants, "constexpr")}
    return triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=ALIGNED), target=target)


def ptx_accesses(ptx: str) -> dict[str, list[str]]:
    """Global loads and stores of a PTX listing by kind (predicated or not) and type, in order."""
    out: dict[str, list[str]] = {"ld": [], "st": [], "masked ld": [], "masked st": []}
    for predicate, op, kind in PTX_ACCESS.findall(ptx):
        out[("masked " if predicate else "") + op].append(kind)
    return out


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.name.lower())
@pytest.mark.parametrize("unit", triton_backend.UNITS)
@pytest.mark.parametrize("cap", sorted(CUDA_TARGETS))
def test_compiles_for_nvidia_moving_each_piece_in_masked_unit_accesses(triton, cap, unit, direction):
    from triton.backends.compiler import GPUTarget

    backend_or_missing(triton, "nvidia")
    compiled = compile_transfer(triton, GPUTarget("cuda", cap, 32), unit, direction)
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    ptx = compiled.asm["ptx"]
    assert re.findall(r"^\.target (\S+)", ptx, re.MULTILINE) == [CUDA_TARGETS[cap]]
    per_thread = BLOCK // (32 * compiled.metadata.num_warps)
    bits = f"b{8 * unit}"
    assert ptx_accesses(ptx) == {"ld": ["b64"] * TABLE_LOADS, "st": [],
                                 "masked ld": [bits] * per_thread, "masked st": [bits] * per_thread}


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.name.lower())
@pytest.mark.parametrize("unit", triton_backend.UNITS)
def test_compiles_for_amd_mi300_moving_each_piece_in_unit_accesses(triton, unit, direction):
    """The table is read with scalar loads (the same for the whole program), so the vector memory accesses
    are the payload only; a wave is 64 threads."""
    from triton.backends.compiler import GPUTarget

    backend_or_missing(triton, "amd")
    compiled = compile_transfer(triton, GPUTarget("hip", AMD_ARCH, 64), unit, direction)
    assert compiled.asm["hsaco"], "the AMD back end produced no code object"
    amdgcn = compiled.asm["amdgcn"]
    assert re.findall(r'^\s*\.amdgcn_target "[\w.]+-amd-amdhsa-\w*-(\w+)"', amdgcn, re.MULTILINE) == [AMD_ARCH]
    per_thread = BLOCK // (64 * compiled.metadata.num_warps)
    accesses = AMD_ACCESS.findall(amdgcn)
    assert accesses == [("load", AMD_LOAD[unit])] * per_thread + [("store", AMD_STORE[unit])] * per_thread


CRC_SIGNATURE = {"words_ptr": "*i32", "out_ptr": "*i32", "tables_ptr": "*i32", "columns_ptr": "*i32",
                 "object_words": "i32", "payload_words": "i32", "stripes": "i32", "share_full": "i32",
                 "share_last": "i32", "LANES": "constexpr", "LANE_WORDS": "constexpr"}


@pytest.mark.parametrize("target", [*(("cuda", cap, 32) for cap in sorted(CUDA_TARGETS)), ("hip", AMD_ARCH, 64)],
                         ids=lambda t: f"{t[0]}-{t[1]}")
def test_the_stripe_crc_kernel_compiles_for_each_gpu(triton, target):
    """The chunk checksum's GPU kernel (``kernels.triton_crc32c``): a code object for each target, and on NVIDIA
    its stripe read as masked 32-bit loads."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmcache_platforms.kernels import triton_crc32c

    backend_or_missing(triton, "nvidia" if target[0] == "cuda" else "amd")
    triton_crc32c._kernel.cache_clear()
    constants = {"LANES": triton_crc32c.LANES, "LANE_WORDS": triton_crc32c.LANE_WORDS}
    source = ASTSource(triton_crc32c._kernel(), CRC_SIGNATURE, constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    compiled = triton.compile(source, target=GPUTarget(*target))
    triton_crc32c._kernel.cache_clear()
    if target[0] == "hip":
        assert compiled.asm["hsaco"], "the AMD back end produced no code object"
        return
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    assert "b32" in ptx_accesses(compiled.asm["ptx"])["masked ld"]


def test_the_ptx_check_sees_vector_accesses_where_the_compiler_emits_them(triton):
    """Negative control: a copy whose pointers the compiler knows to be 16-byte aligned and contiguous is
    vectorized, and the same reading reports ``v4.b32``, so the transfer's single-unit accesses are what it
    emits, not what the reading misses."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend_or_missing(triton, "nvidia")

    @triton.jit
    def aligned_copy(src, dst, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))

    source = ASTSource(aligned_copy, {"src": "*i32", "dst": "*i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 512},
                       attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    ptx = triton.compile(source, target=GPUTarget("cuda", 80, 32)).asm["ptx"]
    accesses = ptx_accesses(ptx)
    assert accesses["ld"] + accesses["masked ld"] == ["v4.b32"]
    assert accesses["st"] + accesses["masked st"] == ["v4.b32"]
