"""The GPU connector a vLLM engine our impl builds gets (``layout_connector``, given to the engine by our service
factory): paged or layerwise, with the configured kernel backend; LMCache's ``CreateGPUConnector`` stays
upstream's for everyone else (other engines, and a vLLM engine built by upstream's adapter when it is kept)."""

from __future__ import annotations

import inspect

import lmcache.v1.gpu_connector as upstream_module
import pytest
import torch
from lmcache.utils import EngineType
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.metadata import LMCacheMetadata

import lmcache_platforms
from lmcache_platforms.connector.factory import layout_connector
from lmcache_platforms.connector.layerwise import LayerwiseLayoutGPUConnector
from lmcache_platforms.connector.paged import LayoutGPUConnector
from lmcache_platforms.kernels.contract import TransferError


def _metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(4, 2, 64, 2, 64), chunk_size=64)


lmcache_platforms.ensure_patched()
upstream_factory = upstream_module.CreateGPUConnector


def create_gpu_connector(config, metadata, engine):
    """The connector a vLLM engine our impl builds gets (the engine type is VLLM there)."""
    assert engine == EngineType.VLLM
    return layout_connector(config, metadata)


def test_activation_leaves_upstreams_factory_in_place() -> None:
    assert upstream_factory.__module__ == "lmcache.v1.gpu_connector"
    assert not hasattr(upstream_factory, "upstream")
    assert list(inspect.signature(upstream_factory).parameters) == ["config", "metadata", "engine", "layout_hints"]


def test_vllm_gets_the_paged_connector_with_the_configured_kernel_backend() -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=64, extra_config={"platforms.kernel_backend": "torch"})
    connector = create_gpu_connector(config, _metadata(), EngineType.VLLM)
    assert isinstance(connector, LayoutGPUConnector)
    assert connector.kernel_backend == "torch"
    assert connector.binding is None and connector.store_stream is None
    with pytest.raises(TransferError, match="no KV layout is bound to the connector yet"):
        connector.get_shape(64)


def test_layerwise_config_gets_the_layerwise_connector_sized_by_the_engine_layers() -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=64, use_layerwise=True)
    connector = create_gpu_connector(config, _metadata(), EngineType.VLLM)
    assert isinstance(connector, LayerwiseLayoutGPUConnector)
    assert connector.num_layers == 4 and connector.kernel_backend == "auto"


def test_a_vllm_engine_not_built_by_our_impl_gets_upstreams_connector() -> None:
    """Upstream's adapter kept (LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER) or vLLM's own copy of it: upstream's
    factory answers, which has no CPU connector; ours would get per-token slots it does not read."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=64)
    with pytest.raises(RuntimeError, match="No supported cpu connector found"):
        upstream_factory(config, _metadata(), EngineType.VLLM)
    assert isinstance(create_gpu_connector(config, _metadata(), EngineType.VLLM), LayoutGPUConnector)


def test_other_engines_go_to_upstream() -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=64)
    assert isinstance(upstream_factory(config, _metadata(), EngineType.MOCK), MockGPUConnector)


def _bound_backends(config: LMCacheEngineConfig, kv_connector_extra_config: dict | None = None) -> list[str]:
    """Kernel backends the connector LMCache's vLLM adapter would create moves ``gemma3``'s planes with."""
    from lmcache_platforms.layout import load_layout_spec
    from lmcache_platforms.tools.fixtures import materialize

    metadata = _metadata()
    metadata.kv_connector_extra_config = kv_connector_extra_config  # what VllmServiceFactory puts there
    connector = create_gpu_connector(config, metadata, EngineType.VLLM)
    connector.bind(materialize(load_layout_spec("gemma3"), "bundled"))
    return connector.binding.backend_names


def test_kernel_backend_precedence_reaches_the_bound_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """extra_config < LMCACHE_PLATFORMS_KERNEL_BACKEND < vLLM's kv_connector_extra_config, as bound."""
    monkeypatch.delenv("LMCACHE_PLATFORMS_KERNEL_BACKEND", raising=False)
    assert _bound_backends(LMCacheEngineConfig.from_defaults(chunk_size=64)) == ["cpu"]  # auto, here
    torch_in_file = LMCacheEngineConfig.from_defaults(chunk_size=64, extra_config={"platforms.kernel_backend": "torch"})
    assert _bound_backends(torch_in_file) == ["torch"]
    monkeypatch.setenv("LMCACHE_PLATFORMS_KERNEL_BACKEND", "cpu")
    assert _bound_backends(torch_in_file) == ["cpu"]
    cpu_in_file = LMCacheEngineConfig.from_defaults(chunk_size=64, extra_config={"platforms.kernel_backend": "cpu"})
    assert _bound_backends(cpu_in_file, {"platforms.kernel_backend": "torch", "lmcache.chunk_size": 64}) == ["torch"]


def test_bad_mode_in_lmcache_extra_config_is_refused() -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=64, extra_config={"platforms.mode": "fused"})
    with pytest.raises(ValueError, match=r"platforms\.mode must be one of bundled, exploded, got 'fused'"):
        create_gpu_connector(config, _metadata(), EngineType.VLLM)
