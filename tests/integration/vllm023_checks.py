"""Checks run under vLLM 0.23 (vllm-ascend's generation), in a subprocess with 0.23 first on the path and
lmcache_platforms activated as vLLM's plugin would (every patch applied, our connector name registered).

0.23 names compression ``compress_ratio`` on MLA specs, has no ``enable_kv_transfer`` / ``tokens_per_state``,
and its scheduler records are the ones vllm-ascend sends; the tracker, the group plan and the per-step
metadata must read them the same way. Then our connector class itself runs under 0.23's classes: built by
0.23's connector factory (which keeps its hybrid KV-cache manager on for it), a worker and a scheduler over a
real LMCache engine store a hybrid model's prefix and load it into another request's blocks.

The worker's layers use vLLM 0.23's FlexAttention backend (pure PyTorch; its caches are [blocks, 2, block,
heads, head]), not its CPU backend: that one's cache layout is probed through vLLM's compiled cache-write op,
and 0.23's compiled ops (``vllm._C``) were built for another torch than this venv's and do not load. K/V are
written with torch indexing, as FlexAttention's own cache update does. Prints one JSON line; any failed
assert exits non-zero.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import vllm
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

import lmcache_platforms
from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.groups import plan_groups
from lmcache_platforms.integration.vllm.request_meta import build_request_meta
from lmcache_platforms.integration.vllm.tracker import RequestTracker

BF16 = torch.bfloat16
BLOCK, HEADS, HEAD, WINDOW = 32, 1, 64, 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def records() -> dict[str, Any]:
    """Tracker, group plan and per-step metadata from 0.23's own records."""
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=BF16)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=BF16,
                                                    sliding_window=128)),
        KVCacheGroupSpec(["c4"], MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=512, dtype=BF16,
                                                  compress_ratio=4)),
    ]
    plan = plan_groups(groups, PlatformSettings())
    assert plan.saved == (0, 1, 2), plan.describe()
    assert [(g.block_size, g.tokens_per_row, g.sliding_window) for g in plan.groups] == \
        [(128, 1, None), (128, 1, 128), (32, 4, None)]

    new = NewRequestData(req_id="r", prompt_token_ids=list(range(300)), mm_features=[], sampling_params=None,
                         pooling_params=None, block_ids=([1, 2], [3, 4], [5, 6]), num_computed_tokens=0,
                         lora_request=None)
    tracker = RequestTracker.from_new_request(new, 3, 256, 0, False)
    cached = CachedRequestData(req_ids=["r"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                               new_block_ids=[([7], [8], [9])], num_computed_tokens=[256], num_output_tokens=[0])
    tracker.append(list(range(256, 300)), cached.new_block_ids[0])
    assert tracker.block_ids == [[1, 2, 7], [3, 4, 8], [5, 6, 9]]
    meta = build_request_meta(tracker, plan, 64)
    assert meta is not None and meta.save_spec.num_tokens == 256
    assert meta.block_ids == ((1, 2, 7), (3, 4, 8), (5, 6, 9))
    assert meta.failed_blocks(200, 256) == {2, 4, 6}
    return {"plan": plan.describe()}


def activation() -> dict[str, Any]:
    """Every applicable catalog patch applied to 0.23 and LMCache; our name in 0.23's connector factory."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector

    state = lmcache_platforms.activate()
    assert state.activated and state.registry is not None
    state.registry.import_targets()
    report = {p["target"]: p["state"] for p in state.registry.report()}
    assert all(s in ("applied", "not applicable") for s in report.values()), report
    assert report["vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory.register_connector"] == \
        "not applicable"  # vllm-ascend is not installed here; tests/upstream_fixes/test_catalog.py covers it
    import lmcache.integration.vllm.vllm_v1_adapter as adapter

    assert adapter.LMCacheConnectorV1Impl.__module__ == "lmcache_platforms.integration.vllm.engine_impl"
    assert KVConnectorFactory.get_connector_class_by_name("LMCachePlatformsConnector") is LMCachePlatformsConnector
    assert supports_hma(LMCachePlatformsConnector)
    return {"patches": report, "connectors": lmcache_platforms.status()["connectors"]}


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """Gemma-3 as 0.23's hybrid manager groups it: one full-attention layer, three sliding-window layers."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=BF16)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=BF16,
                                sliding_window=WINDOW)
    groups = [KVCacheGroupSpec([LAYERS[3]], full)] + [KVCacheGroupSpec([n], sliding) for n in LAYERS[:3]]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(size=1, shared_by=LAYERS)],
                         kv_cache_groups=groups)


def write_kv(caches: dict[str, torch.Tensor], config: KVCacheConfig, tokens: list[int],
             block_ids: tuple[list[int], ...]) -> None:
    """What the forward does with FlexAttention: K and V of each token at its group's slot."""
    for index, group in enumerate(config.kv_cache_groups):
        ids = torch.tensor(block_ids[index])
        positions = torch.arange(len(tokens))
        blocks, offsets = ids[positions // BLOCK], positions % BLOCK
        real = blocks != 0
        for name in group.layer_names:
            t = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1)
            key = torch.sin(t * 0.37 + torch.arange(HEAD).view(1, 1, -1) * 0.11 + LAYERS.index(name)).to(BF16)
            caches[name][blocks[real], 0, offsets[real]] = key[real]
            caches[name][blocks[real], 1, offsets[real]] = -key[real]


def rows(caches: dict[str, torch.Tensor], name: str, block_ids: list[int], tokens: range) -> torch.Tensor:
    """K and V of ``tokens`` in layer ``name`` read from the request's blocks."""
    positions = torch.tensor(list(tokens))
    ids = torch.tensor(block_ids)
    return caches[name][ids[positions // BLOCK], :, positions % BLOCK]


def connector_end_to_end(model: str) -> dict[str, Any]:
    """Our connector class under 0.23: factory-built, HMA kept, a prefix stored and loaded elsewhere."""
    from vllm import SamplingParams
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.request import Request

    from lmcache_platforms.integration.vllm import health
    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector
    from tests.integration.vllm_env import vllm_config
    from tests.integration.vllm_stack import destroy_distributed, init_distributed

    assert vllm_config(model, "LMCacheConnectorV1").scheduler_config.disable_hybrid_kv_cache_manager is True
    config = vllm_config(model, "LMCachePlatformsConnector")
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kv_config = kv_cache_config(num_blocks=64)
    init_distributed(config)
    with set_current_vllm_config(config):
        for name in LAYERS:
            Attention(2, HEAD, HEAD**-0.5, num_kv_heads=HEADS, cache_config=config.cache_config, prefix=name,
                      attn_backend=FlexAttentionBackend)
        worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_config)
        shape = FlexAttentionBackend.get_kv_cache_shape(kv_config.num_blocks, BLOCK, HEADS, HEAD)
        caches = {name: torch.zeros(shape, dtype=BF16) for name in LAYERS}
        worker.register_kv_caches(caches)
        scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_config)
    try:
        assert isinstance(worker, LMCachePlatformsConnector) and isinstance(scheduler, LMCachePlatformsConnector)
        assert type(worker.impl).__name__ == "MultiGroupConnectorImpl"
        assert not health.is_degraded(), health.engine_health()
        binding = worker.impl.lmcache_engine.gpu_connector.binding

        def step(req_id: str, prompt: list[int], table: tuple[list[int], ...], write: bool) -> int:
            """vLLM 0.23's scheduler and worker for one new request; the tokens LMCache had for it."""
            req = Request(req_id, prompt, SamplingParams(max_tokens=4), None)
            hit, is_async = scheduler.get_num_new_matched_tokens(req, 0)
            assert is_async is False
            scheduler.update_state_after_alloc(req, None, hit)
            req.num_computed_tokens = hit
            new = NewRequestData.from_request(req, table)
            output = SchedulerOutput(
                scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
                num_scheduled_tokens={req_id: len(prompt) - hit}, total_num_scheduled_tokens=len(prompt) - hit,
                scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0] * 4,
                finished_req_ids=set(), free_encoder_mm_hashes=[])
            worker.bind_connector_metadata(scheduler.build_connector_meta(output))
            try:
                worker.start_load_kv(None)  # 0.23 calls it every step
                if write:
                    write_kv(caches, kv_config, prompt, table)
                worker.wait_for_save()
            finally:
                worker.clear_connector_metadata()
            return hit

        prompt = list(range(1000, 1200))
        table_a = ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21],
                   [22, 23, 24, 25, 26, 27, 28])
        assert step("a", prompt, table_a, write=True) == 0
        assert binding.counters.chunks_stored == 3  # 200 tokens: three whole chunks of 64
        table_b = ([29, 30, 31, 32, 33, 34, 35, 36], [0, 0, 0, 0, 37, 38, 39, 40], [0, 0, 0, 0, 41, 42, 43, 44],
                   [0, 0, 0, 0, 45, 46, 47, 48])
        assert step("b", prompt[:192] + list(range(5000, 5040)), table_b, write=False) == 192
        assert binding.counters.chunks_loaded == 3
        full = rows(caches, LAYERS[3], table_a[0], range(192))
        assert full.any() and full.equal(rows(caches, LAYERS[3], table_b[0], range(192)))
        for index, name in enumerate(LAYERS[:3], start=1):
            window = range(192 - WINDOW, 192)
            assert rows(caches, name, table_b[index], window).equal(rows(caches, name, table_a[index], window))
        return {"backends": binding.backend_names, "layout": worker.impl.layout.summary()["transfer_groups"],
                "chunks_stored": binding.counters.chunks_stored, "chunks_loaded": binding.counters.chunks_loaded}
    finally:
        worker.shutdown()  # the worker first: see tests/integration/vllm_stack.stop_stack
        scheduler.shutdown()
        destroy_distributed()


def main(model: str) -> None:
    assert vllm.__version__.startswith("0.23"), vllm.__version__
    result = {"vllm": vllm.__version__, **records(), **activation(), **connector_end_to_end(model)}
    print(json.dumps(result))


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
