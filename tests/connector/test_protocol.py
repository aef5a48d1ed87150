"""Our GPU connectors satisfy ``LayoutConnector``, the contract the vLLM integration relies on; upstream's do not,
which is how the integration tells them apart."""

from __future__ import annotations

import pytest
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2, VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

from lmcache_platforms.connector.layerwise import LayerwiseLayoutGPUConnector
from lmcache_platforms.connector.paged import LayoutGPUConnector
from lmcache_platforms.connector.protocol import LayoutConnector
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools.engine import engine_metadata
from lmcache_platforms.tools.fixtures import materialize


@pytest.mark.parametrize("cls", [LayoutGPUConnector, LayerwiseLayoutGPUConnector])
def test_ours_satisfy_the_contract_before_and_after_bind(cls) -> None:
    layout = materialize(load_layout_spec("llama"))
    connector = cls(engine_metadata(layout, "m", len(layout.layers)), kernel_backend="torch")
    assert isinstance(connector, LayoutConnector)
    assert connector.binding is None
    connector.bind(layout)
    assert connector.binding is not None and connector.binding.key_tags


@pytest.mark.parametrize("cls", [VLLMPagedMemGPUConnectorV2, VLLMPagedMemLayerwiseGPUConnector, MockGPUConnector])
def test_upstreams_do_not(cls) -> None:
    assert not isinstance(object.__new__(cls), LayoutConnector)
