"""The LMCache config of our passes and the spec every pass gets."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import yaml

from lmcache_platforms.tools.demo.engine_pass import pass_spec
from lmcache_platforms.tools.demo.model import TINY_MODEL
from lmcache_platforms.tools.demo.scenario import BLOCK_SIZE, OUR_CONNECTOR, connector_config, lmcache_yaml
from lmcache_platforms.tools.demo.workload import TINY_WORKLOAD, build_workload


def test_lmcache_config_is_a_local_cpu_cache_over_a_file_store(tmp_path: Path) -> None:
    config = yaml.safe_load(lmcache_yaml(256, tmp_path / "store", cpu_gib=1.5))
    assert config["chunk_size"] == 256
    assert config["local_cpu"] is True and config["max_local_cpu_size"] == 1.5
    url = urlparse(config["remote_url"])
    assert url.scheme == "fs" and url.hostname and url.port is not None
    assert url.path == str((tmp_path / "store").resolve())


def test_pass_spec_has_the_workload_and_a_warmup_as_long_as_the_longest_request(tmp_path: Path) -> None:
    requests = build_workload(TINY_WORKLOAD, TINY_MODEL.vocab_size)
    spec = pass_spec(tmp_path, TINY_MODEL, TINY_WORKLOAD, requests, "cold", connector_config(OUR_CONNECTOR))
    assert spec["kv_transfer_config"] == {"kv_connector": OUR_CONNECTOR, "kv_role": "kv_both"}
    assert spec["block_size"] == BLOCK_SIZE and BLOCK_SIZE % 32 == 0
    assert [r["tokens"] for r in spec["requests"]] == [r.tokens for r in requests]
    assert len(spec["warmup"]["tokens"]) == max(len(r.tokens) for r in requests)
    other = pass_spec(tmp_path, TINY_MODEL, TINY_WORKLOAD, requests, "warm", None)
    assert other["warmup"]["tokens"] != spec["warmup"]["tokens"]
