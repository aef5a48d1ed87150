"""The ``vllm serve`` argv the tools and served tests start: a one-rank engine gets vLLM's one-process executor
(its worker inside the engine core, as on a GPU); any parallelism or executor the caller names is left to vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.server import IN_CORE_WORKER, runs_one_rank, serve_command


def test_a_one_rank_server_runs_its_worker_in_the_engine_core() -> None:
    argv = serve_command(Path("/m"), 8123, {"kv_connector": "X"}, ["--enforce-eager"])
    assert argv[1:] == ["serve", "/m", "--host", "127.0.0.1", "--port", "8123",
                        "--kv-transfer-config", '{"kv_connector": "X"}', "--enforce-eager", *IN_CORE_WORKER]


@pytest.mark.parametrize("args", [
    ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["-tp", "2"], ["-tp=2"],
    ["--pipeline-parallel-size", "2"], ["-pp", "2"], ["--data-parallel-size", "2"], ["-dp", "2"],
    ["--distributed-executor-backend", "mp"], ["--distributed-executor-backend=ray"],
])
def test_parallel_or_named_executors_are_left_to_vllm(args: list[str]) -> None:
    assert not runs_one_rank(args)
    assert serve_command(Path("/m"), 1, None, args)[-len(args):] == args


def test_other_arguments_keep_one_rank() -> None:
    assert runs_one_rank(["--max-model-len", "1024", "--api-server-count", "2", "--enable-prefix-caching"])
