"""Every shipped example, both modes, every available kernel backend: bit-exact through a real LMCacheEngine."""

from __future__ import annotations

import importlib.util

import pytest

from lmcache_platforms.kernels.registry import describe_backends
from lmcache_platforms.layout import example_names, load_layout_spec
from lmcache_platforms.tools.fixtures import materialize
from tests.connector.roundtrip_case import round_trip

pytestmark = pytest.mark.slow

# The two bench-sized examples hold hundreds of MB of planes: two chunks of them prove the same thing.
BIG = {"llama8b", "deepseek-v4"}
AVAILABLE = [row["name"] for row in describe_backends() if row["available"]]
TRITON = importlib.util.find_spec("triton") is not None


def _tokens(name: str) -> int:
    spec = load_layout_spec(name)
    return 2 * spec.chunk_size if name in BIG else spec.num_tokens


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("mode", ["bundled", "exploded"])
@pytest.mark.parametrize("name", [n for n in example_names() if n not in BIG])
def test_small_examples_bit_exact(name: str, mode: str, backend: str) -> None:
    layout = materialize(load_layout_spec(name), mode, seed=3)
    result = round_trip(layout, _tokens(name), backend=backend)
    assert result["bit_exact"], result["problems"]
    assert result["backend"] == backend
    assert result["chunks_hit"] == result["chunks_stored"] > 0
    assert result["rows_checked"] > 0


@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", [n for n in example_names() if n not in BIG])
def test_triton_under_the_interpreter_is_bit_exact(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton on CPU tensors through its interpreter, which is slow: one chunk, bundled mode (the selftest
    CLI test runs it in exploded mode)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layout = materialize(load_layout_spec(name), "bundled", seed=3)
    result = round_trip(layout, layout.chunk_size, backend="triton")
    assert result["bit_exact"], result["problems"]
    assert result["backend"] == "triton" and result["chunks_hit"] == 1


@pytest.mark.parametrize("mode", ["bundled", "exploded"])
@pytest.mark.parametrize("name", sorted(BIG))
def test_bench_sized_examples_bit_exact(name: str, mode: str) -> None:
    layout = materialize(load_layout_spec(name), mode, seed=3)
    result = round_trip(layout, _tokens(name))
    assert result["bit_exact"], result["problems"]
    assert result["chunks_hit"] == result["chunks_stored"] == 2
