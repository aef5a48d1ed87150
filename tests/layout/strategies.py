"""Hypothesis strategies for random KV groups, layout specs and block tables (shared by every test folder)."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.slots import rows_for_tokens
from lmcache_platforms.layout.spec import LayerSpec, LayoutSpec, PlaneSpec

DTYPES = ("int8", "uint8", "float16", "bfloat16", "float32")
SPEC_NAMES = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "MambaStateSpec")

# dims in memory order; "h"/"d"/"c"/"e" are row dims (transposed K puts "d" before "bs")
DIM_TEMPLATES = (
    ("nb", "bs", "d"),
    ("nb", "bs"),
    ("nb", "kv", "bs", "h", "d"),
    ("kv", "nb", "bs", "h", "d"),
    ("nb", "h", "bs", "d"),
    ("nb", "h", "kv", "bs", "d"),
    ("nb", "c", "bs", "e"),
    ("nb", "h", "d", "bs"),
)


# Chunk sizes and the largest group's tokens per block include non-powers of two (a 16-token block under a
# 48-token chunk, a 24-token block under a 16-token chunk): chunk boundaries then fall inside blocks.
CHUNK_SIZES = (8, 12, 16, 24, 32, 48, 64)
LARGEST_BLOCK_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
COMPRESS_RATIOS = (1, 2, 3, 4, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def kv_groups(draw, max_groups: int = 4, chunk_size: int | None = None,
              snapshots: bool = False) -> tuple[list[KVGroup], int]:
    """(groups, chunk_size) obeying the layout rules: every group's block (in tokens) divides the largest one,
    compress ratios divide the chunk, the block and the window; sizes need not be powers of two. With
    ``snapshots``, groups after the first may be snapshot groups (one row per block dividing the chunk)."""
    chunk = chunk_size or draw(st.sampled_from(CHUNK_SIZES))
    largest = draw(st.sampled_from(LARGEST_BLOCK_TOKENS))
    count = draw(st.integers(1, max_groups))
    biggest = draw(st.integers(0, count - 1))  # the group whose block is the largest; the others divide it
    groups = []
    for index in range(count):
        tokens_per_block = largest if index == biggest else draw(st.sampled_from(_divisors(largest)))
        cr = draw(st.sampled_from([c for c in COMPRESS_RATIOS if chunk % c == 0 and tokens_per_block % c == 0]))
        window = draw(st.one_of(st.none(), st.integers(1, 3 * chunk // cr).map(lambda k, cr=cr: k * cr)))
        name = draw(st.sampled_from(SPEC_NAMES))
        if snapshots and index > 0 and chunk % tokens_per_block == 0 and draw(st.booleans()):
            groups.append(KVGroup(index=index, block_size=1, tokens_per_row=tokens_per_block, is_state=True,
                                  spec_name="MambaSpec", snapshots=True))
            continue
        groups.append(KVGroup(
            index=index,
            block_size=tokens_per_block // cr,
            tokens_per_row=cr,
            sliding_window=window,
            is_state=draw(st.booleans()) and index > 0,
            spec_name=name,
        ))
    return groups, chunk


@st.composite
def block_table(
    draw, group: KVGroup, num_tokens: int, num_blocks: int | None = None, null_fraction: bool = True
) -> list[int]:
    """Distinct non-null block ids (below ``num_blocks``) covering ``num_tokens``, some set to null block 0."""
    needed = math.ceil(rows_for_tokens(num_tokens, group) / group.block_size)
    num_blocks = num_blocks or needed + 8
    ids = draw(st.permutations(range(1, num_blocks)))[:needed]
    if null_fraction:
        nulls = draw(st.lists(st.booleans(), min_size=needed, max_size=needed))
        ids = [0 if null else b for b, null in zip(ids, nulls, strict=True)]
    return list(ids)


@st.composite
def plane_specs(draw, group: int, block_size: int, num_blocks: int) -> PlaneSpec:
    dims = draw(st.sampled_from(DIM_TEMPLATES))
    sizes = {"nb": num_blocks + draw(st.integers(0, 2)), "bs": block_size, "kv": 2}
    shape = tuple(sizes.get(d) or draw(st.integers(1, 5)) for d in dims)
    return PlaneSpec(group, shape, dims, draw(st.sampled_from(DTYPES)))


@st.composite
def layout_specs(draw, max_groups: int = 3, max_layers: int = 3, every_group: bool = False,
                 min_chunks: int = 0, snapshots: bool = False) -> LayoutSpec:
    """A small random layout file (a few KiB of tensors) that passes every check.

    ``every_group``: each group has at least one plane, as every vLLM group has layers; ``min_chunks``: the
    file's tokens fill at least that many whole chunks; ``snapshots``: groups may be snapshot groups.
    """
    groups, chunk = draw(kv_groups(max_groups=max_groups, snapshots=snapshots))
    num_tokens = draw(st.integers(max(1, min_chunks * chunk), max(3, min_chunks + 1) * chunk))
    num_blocks = tuple(
        math.ceil(rows_for_tokens(num_tokens, g) / g.block_size) + 1 + draw(st.integers(0, 2)) for g in groups
    )
    layers: list[list[PlaneSpec]] = []
    for _ in range(draw(st.integers(1, max_layers))):
        planes = []
        for _ in range(draw(st.integers(1, 3))):
            g = draw(st.sampled_from(groups))
            planes.append(draw(plane_specs(g.index, g.block_size, num_blocks[g.index])))
        layers.append(planes)
    if every_group:
        for g in groups:
            if not any(p.group == g.index for planes in layers for p in planes):
                target = draw(st.integers(0, len(layers) - 1))
                layers[target].append(draw(plane_specs(g.index, g.block_size, num_blocks[g.index])))
    return LayoutSpec(
        name="random",
        chunk_size=chunk,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        groups=tuple(groups),
        layers=tuple(LayerSpec(f"model.layers.{i}", tuple(
            PlaneSpec(p.group, p.shape, p.dims, p.dtype, f"p{j}") for j, p in enumerate(planes)))
            for i, planes in enumerate(layers)),
        shared_buffer=draw(st.booleans()),
        block_padding_bytes=draw(st.sampled_from((0, 4, 12, 64))),
    )
