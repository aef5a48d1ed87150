"""The plane table is defined once (``kernels/plane_table.py``: FIELDS, ABI_VERSION); these tests tie every kernel's
reading of it to that definition: the generated C header, the C library's struct layout as a compiler lays it out,
the Ascend C kernel and binding, and the Triton kernel's offsets."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmcache_platforms.kernels import native_library, triton_backend
from lmcache_platforms.kernels.plane_table import ABI_VERSION, FIELD, FIELDS, HEADER_PATH, c_header

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / HEADER_PATH
INCLUDE = '#include "../lmcp_plane_table.h"'


def source(path: str) -> str:
    return (REPO / path).read_text()


def test_the_header_is_generated_from_the_python_definition() -> None:
    assert HEADER.read_text() == c_header(), "run scripts/gen_plane_table_header.py"


def test_the_c_struct_as_compiled_has_the_python_field_order_and_offsets(tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    probe = tmp_path / "probe.c"
    prints = "".join(f'printf("{name} %zu\\n", offsetof(lmcp_plane, {name}));' for name in FIELDS)
    probe.write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "{HEADER}"\n'
                     f'int main(void) {{ {prints} printf("size %zu\\nabi %d\\n", sizeof(lmcp_plane), '
                     f'LMCP_ABI_VERSION); return 0; }}\n')
    subprocess.run([compiler, str(probe), "-o", str(tmp_path / "probe")], check=True)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True).stdout
    measured = dict(line.split() for line in out.splitlines())
    assert {name: int(measured[name]) for name in FIELDS} == {name: 8 * i for name, i in FIELD.items()}
    assert (int(measured["size"]), int(measured["abi"])) == (8 * len(FIELDS), ABI_VERSION)


def test_the_cpu_library_reports_the_python_abi_version() -> None:
    lib, reason = native_library.load_library()
    if lib is None:
        pytest.skip(reason)
    assert lib.lmcp_abi_version() == ABI_VERSION


def test_the_c_and_ascend_sources_take_the_table_only_from_the_header() -> None:
    c = source("csrc/cpu/kv_transfer.c")
    assert INCLUDE in c and "typedef struct {\n    int64_t base;" not in c
    assert "int lmcp_abi_version(void) { return LMCP_ABI_VERSION; }" in c
    binding = source("csrc/ascend/torch_binding.cpp")
    assert INCLUDE in binding and "return LMCP_ABI_VERSION;" in binding and "kAbiVersion" not in binding
    assert "table.size(1) == LMCP_PLANE_FIELDS" in binding
    kernel = source("csrc/ascend/kv_transfer_kernel.cpp")
    assert INCLUDE in kernel and "const int64_t f = plane * LMCP_PLANE_FIELDS;" in kernel
    reads = re.findall(r"(\w+) = fields\.GetValue\(f \+ (\w+)\);", kernel)
    assert reads == [(name, f"LMCP_F_{name.upper()}") for name in FIELDS]
    assert not re.search(r"GetValue\(f \+ \d", kernel)


def test_the_triton_kernel_reads_each_field_at_its_python_offset() -> None:
    kernel = inspect.getsource(triton_backend._kernel)
    reads = re.findall(r"(\w+) = tl\.load\(entry \+ (\w+)\)", kernel)
    assert reads == [(name, name.upper()) for name in triton_backend._TABLE_FIELDS_READ]
    assert set(triton_backend._TABLE_FIELDS_READ) <= set(FIELDS)
    assert "entry = table_ptr + plane * FIELD_COUNT" in kernel
