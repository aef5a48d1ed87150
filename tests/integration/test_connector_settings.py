"""What vLLM's ``--kv-transfer-config`` does to our connector, through vLLM's real config and a real LMCache
engine: ``platforms.*`` keys in ``kv_connector_extra_config`` win over the environment, LMCache's layerwise
mode is accepted (our worker side takes it over), a bad mode is refused, and a model with a group we cannot
restore never claims a hit."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
from vllm.v1.request import Request

from lmcache_platforms.integration.vllm import health
from tests.fork_server import run_module
from tests.integration.specs import gemma_like, group, mamba
from tests.integration.test_end_to_end import PROMPT, TABLE_A, admit
from tests.integration.vllm_env import vllm_config
from tests.integration.vllm_stack import Stack, start_stack, stop_stack

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# Set in the environment and overridden by kv_connector_extra_config (auto would pick "cpu" here).
ENV = {"LMCACHE_PLATFORMS_KERNEL_BACKEND": "cpu", "LMCACHE_PLATFORMS_MODE": "bundled"}
VLLM_EXTRA = {"platforms.kernel_backend": "torch", "platforms.mode": "exploded"}


def with_unrestorable_group(window: int = 64) -> KVCacheConfig:
    """The Gemma-like model plus a Mamba layer: recurrent state LMCache chunks cannot restore."""
    base = gemma_like(window)
    names = [n for g in base.kv_cache_groups for n in g.layer_names] + ["model.layers.4.mixer"]
    return KVCacheConfig(num_blocks=base.num_blocks, kv_cache_groups=[*base.kv_cache_groups,
                                                                      group([names[-1]], mamba())],
                         kv_cache_tensors=[KVCacheTensor(size=1, layers=names, layer_stride=1, block_stride=1)])


def test_a_cpu_buffer_beyond_the_memory_left_is_refused_before_lmcache_allocates_it(model_dir) -> None:
    """LMCache allocates its CPU buffer once vLLM's KV cache took its share (on CPU, by default about 90 % of the
    memory); one that cannot fit any more is refused at ``register_kv_caches``, naming both sizes, instead of
    the worker being killed for memory."""
    from types import SimpleNamespace

    from lmcache_platforms.integration.vllm.lifecycle import refuse_cpu_tier_beyond

    refuse_cpu_tier_beyond(SimpleNamespace(max_local_cpu_size=2.0), 2 * 2**30)  # fits exactly
    with pytest.raises(MemoryError, match=r"\(max_local_cpu_size: 2.0 GiB\) does not fit in the 1.5 GiB of memory "
                                          r"left after vLLM's KV cache: .*VLLM_CPU_KVCACHE_SPACE"):
        refuse_cpu_tier_beyond(SimpleNamespace(max_local_cpu_size=2.0), 3 * 2**29)
    health.forget()
    with pytest.raises(MemoryError, match=r"max_local_cpu_size: 1000000(\.0)? GiB\) does not fit"):
        start_stack(vllm_config(model_dir, "LMCachePlatformsConnector", **{"lmcache.max_local_cpu_size": 1000000}),
                    gemma_like(64, num_blocks=64))


def test_use_layerwise_is_accepted_and_a_bad_mode_or_lmcaches_async_loading_refused(model_dir) -> None:
    """In a subprocess: see tests/integration/vllm_refusals.py."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LMCACHE_PLATFORMS_MODE", None)
    proc = run_module("tests.integration.vllm_refusals", [str(model_dir)], env, REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = json.loads(proc.stdout.strip().splitlines()[-1])
    assert refused["use_layerwise"] is None
    assert refused["bad_mode"] == "ValueError: platforms.mode must be one of bundled, exploded, got 'fused'"
    # LMCache's own async loading knows none of our chunk parts or recurrent states (under the fuzzer, concurrent
    # hits of one prefix failed to load and recurrent models answered nothing): refused before its services start.
    assert refused["lmcache_async_loading"] == (
        "ValueError: LMCache's enable_async_loading is not supported by lmcache_platforms' connector (LMCache's "
        "prefetching lookup and load know one object per chunk, none of its parts or recurrent states): set "
        "enable_async_loading to false; platforms.load_mode=async loads a hit while its request waits, other "
        "requests running meanwhile")
    # CacheBlend: the scheduler used to accept it and the worker's engine then ran degraded.
    assert refused["lmcache_blending"] == (
        "ValueError: LMCache's enable_blending is not supported by lmcache_platforms' connector (CacheBlend keys and "
        "loads token segments, not the chunks our layouts move): set enable_blending to false")
    # A remote serde other than naive: cachegen ended the engine at its first store (an object reshaped as
    # LMCache's own KV layout).
    assert refused["cachegen_serde"] == (
        "ValueError: LMCache's remote_serde 'cachegen' is not supported by lmcache_platforms' connector (its codec "
        "re-encodes an object as LMCache's own KV layout; ours are chunk objects with their own layout and "
        "checksum): set remote_serde to naive")


@pytest.fixture(scope="module")
def tuned(model_dir) -> Iterator[Stack]:
    """Both connector halves for the Gemma-like model plus a Mamba group, configured through
    kv_connector_extra_config against contrary environment variables (one stack per process: two
    schedulers would each wait for the other's socket when LMCache terminates its shared ZMQ context)."""
    health.forget()
    config = vllm_config(model_dir, "LMCachePlatformsConnector", **VLLM_EXTRA)
    with pytest.MonkeyPatch.context() as env:  # settings are read when the connectors are built
        for name, value in ENV.items():
            env.setenv(name, value)
        stack = start_stack(config, with_unrestorable_group())
    yield stack
    stop_stack(stack)


def store_prefix(stack: Stack) -> int:
    """Store PROMPT's first three chunks through the worker's LMCache engine, as the worker's save would were
    the model restorable; the tokens LMCache then finds for PROMPT."""
    impl = stack.worker.impl
    engine = impl.lmcache_engine
    tokens = torch.tensor(PROMPT[:192])
    engine.store(tokens, block_ids=[*TABLE_A, [29, 30, 31, 32, 33, 34, 35]], request_configs=impl._key_tags)
    return engine.lookup(torch.tensor(PROMPT), request_configs=impl._key_tags)


def test_kv_connector_extra_config_selects_the_kernel_backend_of_the_bound_layout(tuned) -> None:
    binding = tuned.worker.impl.lmcache_engine.gpu_connector.binding
    assert binding.backend_names == ["torch"]
    stored_before = binding.counters.chunks_stored
    assert store_prefix(tuned) == 192
    # the stack's first store of PROMPT's prefix: its three chunks of 64 tokens, all through the torch kernel
    assert (binding.counters.chunks_stored - stored_before, binding.counters.backends) == (3, {"torch"})


def test_kv_connector_extra_config_selects_the_mode_of_the_bound_layout(tuned) -> None:
    assert tuned.worker.impl.layout.mode == "exploded"


def test_a_model_with_an_unrestorable_group_saves_nothing_and_claims_no_hit(tuned) -> None:
    plan = tuned.scheduler.impl.plan
    assert plan.saved == (0, 1, 2, 3) and list(plan.unrestorable) == [4] and not plan.hits_allowed
    table = ([36, 37, 38, 39, 40, 41, 42], [43, 44, 45, 46, 47, 48, 49], [50, 51, 52, 53, 54, 55, 56],
             [57, 58, 59, 60, 61, 62, 63], [1, 2, 3, 4, 5, 6, 7])
    binding = tuned.worker.impl.lmcache_engine.gpu_connector.binding
    stored_before = binding.counters.chunks_stored
    hit, step = admit(tuned, "fresh", list(range(7000, 7200)), table)
    tuned.step(step, {})
    assert (hit, binding.counters.chunks_stored) == (0, stored_before)

    assert store_prefix(tuned) == 192  # LMCache holds PROMPT's prefix ...
    request = Request("u", PROMPT, SamplingParams(max_tokens=1), None)
    assert tuned.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # ... but no hit is claimed
