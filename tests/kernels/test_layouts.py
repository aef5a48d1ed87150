"""Every available backend against `torch` on the shipped example layouts and on random layout files."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels.cpu_backend import BACKEND as CPU
from lmcache_platforms.layout.files import example_names, load_layout_spec
from lmcache_platforms.layout.slots import rows_for_tokens
from lmcache_platforms.tools.fixtures import materialize
from tests.kernels.checks import assert_load_matches_torch, assert_store_matches_torch, interpreter
from tests.layout.strategies import block_table, layout_specs

BENCH_SIZED = {"llama8b", "deepseek-v4"}  # hundreds of MB: one chunk, bundled only, native backend only
needs_cpu = pytest.mark.skipif(not CPU.availability()[0], reason=CPU.availability()[1])


def random_block_ids(spec, seed: int) -> list[torch.Tensor]:
    """Distinct non-null block ids per group, enough for the layout's tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for group, blocks in zip(spec.groups, spec.num_blocks, strict=True):
        need = math.ceil(rows_for_tokens(spec.num_tokens, group) / group.block_size)
        ids.append(torch.randperm(blocks - 1, generator=gen)[:need] + 1)
    return ids


def chunk_moves(layout, spec, block_ids, max_chunks: int):
    """(planes, slots) of every transfer group for the first chunks (the last one may be partial)."""
    chunks = min(max_chunks, math.ceil(spec.num_tokens / spec.chunk_size))
    for c in range(chunks):
        start, end = c * spec.chunk_size, min((c + 1) * spec.chunk_size, spec.num_tokens)
        for tg in layout.transfer_groups:
            yield tg.planes, layout.chunk_slots(tg, block_ids, start, end)


def check_layout(backend, spec, mode: str, max_chunks: int, seed: int = 0) -> int:
    layout = materialize(spec, mode, seed=seed)
    moved = 0
    for planes, slots in chunk_moves(layout, spec, random_block_ids(spec, seed), max_chunks):
        assert_store_matches_torch(backend, planes, slots, seed)
        assert_load_matches_torch(backend, planes, slots, seed + 1)
        moved += int((slots >= 0).sum())
    return moved


@needs_cpu
@pytest.mark.parametrize("mode", ["bundled", "exploded"])
@pytest.mark.parametrize("name", sorted(set(example_names()) - BENCH_SIZED))
def test_cpu_on_shipped_examples(name, mode):
    assert check_layout(CPU, load_layout_spec(name), mode, max_chunks=4) > 0


@needs_cpu
@pytest.mark.parametrize("name", sorted(BENCH_SIZED & set(example_names())))
def test_cpu_on_bench_layouts(name):
    assert check_layout(CPU, load_layout_spec(name), "bundled", max_chunks=1) > 0


@pytest.mark.parametrize("name", sorted(set(example_names()) - BENCH_SIZED))
def test_triton_interpreter_on_shipped_examples(name):
    """Bundled only: the interpreter is slow, and exploded groups are subsets of the bundled ones."""
    pytest.importorskip("triton")
    with interpreter() as backend:
        assert check_layout(backend, load_layout_spec(name), "bundled", max_chunks=1) > 0


@needs_cpu
@settings(max_examples=40, deadline=None)
@given(spec=layout_specs(), mode=st.sampled_from(["bundled", "exploded"]), data=st.data())
def test_cpu_on_random_layouts(spec, mode, data):
    layout = materialize(spec, mode, seed=3)
    block_ids = [data.draw(block_table(g, spec.num_tokens, spec.num_blocks[g.index])) for g in spec.groups]
    for planes, slots in chunk_moves(layout, spec, block_ids, max_chunks=3):
        assert_store_matches_torch(CPU, planes, slots, 5)
        assert_load_matches_torch(CPU, planes, slots, 6)
