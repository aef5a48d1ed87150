"""The CRC-32C paths of a CPU this machine is not: aarch64 (Ascend hosts are often Kunpeng servers), its crc32c
instruction (and PMULL joining thirds) against the table, built with a cross compiler and run under qemu.
Without those tools the tests skip, under CI too: the package mirror they come from may be out of reach there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
DRIVER = Path(__file__).with_name("native") / "crc32c_driver.c"


pytestmark = pytest.mark.skipif(
    CC is None or QEMU is None,
    reason="aarch64-linux-gnu-gcc or qemu-aarch64 is not on PATH (Debian packages gcc-aarch64-linux-gnu and qemu-user; "
           "scripts/test_services.sh installs them where it can, also under CI, where they are not required)")


def _run(crc_source: Path, tmp_path: Path) -> str:
    """Builds the driver with ``crc_source`` for aarch64 and runs it: its one output line."""
    program = tmp_path / "driver"
    subprocess.run([CC, "-O2", "-std=c11", "-pthread", "-static", "-I", str(ROOT / "csrc" / "cpu"), "-o",
                    str(program), str(DRIVER), str(crc_source)], check=True, capture_output=True, text=True)
    return subprocess.run([QEMU, str(program)], check=True, capture_output=True, text=True).stdout.strip()


def test_the_aarch64_instruction_matches_the_table(tmp_path):
    assert _run(ROOT / "csrc" / "cpu" / "crc32c.c", tmp_path) == "hardware 1 check e3069283 mismatches 0"


def test_the_whole_native_library_builds_for_aarch64(tmp_path):
    subprocess.run([CC, "-O3", "-std=c11", "-pthread", "-shared", "-fPIC", "-Werror", "-o", str(tmp_path / "lib.so"),
                    str(ROOT / "csrc" / "cpu" / "kv_transfer.c"), str(ROOT / "csrc" / "cpu" / "crc32c.c")],
                   check=True, capture_output=True, text=True)


@pytest.mark.parametrize("fault, planted", [
    ("the plain CRC-32 instruction (another polynomial) in place of crc32c", ("__crc32cd(", "__crc32d(")),
    ("PMULL's product not aligned before its reduction", ("(uint64_t)product << 1", "(uint64_t)product")),
], ids=["crc32-instruction", "pmull-alignment"])
def test_a_planted_fault_is_caught(tmp_path, fault: str, planted: tuple[str, str]):
    """Negative controls: each fault changes values the driver compares."""
    source = (ROOT / "csrc" / "cpu" / "crc32c.c").read_text()
    assert source.count(planted[0]) >= 1, fault
    changed = tmp_path / "crc32c.c"
    changed.write_text(source.replace(*planted))
    out = _run(changed, tmp_path)
    assert out.startswith("hardware 1 check ") and not out.endswith("mismatches 0"), (fault, out)
