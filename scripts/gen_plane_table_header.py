"""Writes csrc/lmcp_plane_table.h from lmcache_platforms/kernels/plane_table.py (run after changing FIELDS)."""

from pathlib import Path

from lmcache_platforms.kernels.plane_table import HEADER_PATH, c_header

if __name__ == "__main__":
    target = Path(__file__).resolve().parents[1] / HEADER_PATH
    target.write_text(c_header())
    print(f"wrote {target}")
