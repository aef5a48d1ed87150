"""The layerwise connector through LMCacheEngine.store_layer/retrieve_layer: any layout onto any step count."""

from __future__ import annotations

import pytest

from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions
from lmcache_platforms.tools.fixtures import materialize
from tests.connector.roundtrip_case import round_trip

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("name", "mode", "steps"), [
    ("gemma3", "bundled", None),     # one step per layer
    ("gemma3", "exploded", 4),       # 6 planes' entries onto 4 steps of unequal width
    ("deepseek-v4-small", "bundled", 2),
    ("mla-int8", "exploded", 1),     # one step holding every plane
    ("llama", "bundled", 3),         # single group: the partial last chunk is stored too
])
def test_layerwise_round_trip_is_bit_exact(name: str, mode: str, steps: int | None) -> None:
    spec = load_layout_spec(name)
    layout = materialize(spec, mode, seed=5)
    result = round_trip(layout, spec.num_tokens, layerwise=True, layer_steps=steps)
    assert result["bit_exact"], result["problems"]
    assert result["chunks_hit"] == result["chunks_stored"] > 0


def test_more_engine_layers_than_layout_layers_is_refused() -> None:
    layout = materialize(load_layout_spec("llama"), seed=0)
    with pytest.raises(TransferError, match=r"splits chunks into 9 layers but the layout has only 4"):
        LayoutEngine(layout, StorageOptions(max_local_cpu_size=0.02), layerwise=True, layer_steps=9)


def test_a_corrupt_layer_step_object_is_refused_before_the_forward_reads_that_step() -> None:
    """Each step's object has its own checksum; LMCache's layerwise retrieve is not wrapped, so the mismatch
    raises while that step (here the first) loads, before the generator yields it to the forward: hashed as they
    were copied, its rows were zeroed again, and the next step never loaded."""
    import torch

    from lmcache_platforms.connector.checksum import ChecksumMismatch
    from lmcache_platforms.tools import roundtrip

    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=6)
    request = roundtrip.make_request(layout, layout.chunk_size, seed=6)
    with LayoutEngine(layout, StorageOptions(max_local_cpu_size=0.05), layerwise=True, layer_steps=2) as engine:
        engine.store(request.tokens, request.store_ids)
        (_, _, key), = engine.engine.token_database.process_tokens(tokens=torch.tensor(request.tokens),
                                                                   request_configs=engine.tags)
        hot = engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache
        flat = hot[key.split_layers(2)[0]].tensor.reshape(-1).view(torch.uint8)
        flat[7] ^= 0x10
        roundtrip.zero_planes(layout)
        with pytest.raises(ChecksumMismatch, match=r"layerwise step 0: .*\(0, 64\).* fail their checksum"):
            engine.retrieve(request.tokens, request.load_ids)
        assert not any(p.storage.any() for p in roundtrip.all_planes(layout))
