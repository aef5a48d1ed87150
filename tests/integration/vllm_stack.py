"""Both halves of the connector in one process, as vLLM runs them with VLLM_ENABLE_V1_MULTIPROCESSING=0.

Real pieces only: vLLM's config, distributed state (gloo, one rank), Attention layers (they choose the CPU
attention backend), KV caches as vLLM 0.32 allocates them on CPU (bf16 views into one int8 buffer), K/V
written by vLLM's own CPU cache-write kernel, and a real LMCache engine behind our connectors. The
scheduler's lookups reach the worker's lookup server over ZMQ, as in vLLM.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.integration.vllm_env import BLOCK, LAYERS

HEADS, HEAD = 1, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_buffer_caches(num_blocks: int, names: list[str]) -> dict[str, torch.Tensor]:
    """vLLM 0.32 on CPU: every layer a [blocks, heads, block, 2 * head] bf16 view of one int8 buffer."""
    page = HEADS * BLOCK * 2 * HEAD * 2
    buffer = torch.zeros(len(names) * num_blocks * page, dtype=torch.int8)
    return {name: buffer[i * num_blocks * page : (i + 1) * num_blocks * page].view(torch.bfloat16)
            .view(num_blocks, HEADS, BLOCK, 2 * HEAD) for i, name in enumerate(names)}


def token_kv(layer: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K and V of ``tokens`` in ``layer`` (same tokens, same bits)."""
    t = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1)
    d = torch.arange(HEAD, dtype=torch.float32).view(1, 1, -1)
    key = torch.sin(t * 0.37 + d * 0.11 + layer).expand(-1, HEADS, -1).to(torch.bfloat16)
    return key, (-key * 0.5).contiguous()


@dataclass
class Stack:
    vllm_config: Any
    kv_cache_config: Any
    caches: dict[str, torch.Tensor]
    scheduler: Any
    worker: Any
    # Requests admitted into vLLM's WAITING_FOR_REMOTE_KVS state whose loads the next step runs first.
    waiting: set[str] = field(default_factory=set)
    finished_loads: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)

    def write_kv(self, tokens: list[int], block_ids: tuple[list[int], ...]) -> None:
        """What the model's forward does: every layer writes its K/V at its own group's slots."""
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        for index, group in enumerate(self.kv_cache_config.kv_cache_groups):
            ids = torch.tensor(block_ids[index])
            positions = torch.arange(len(tokens))
            slots = ids[positions // BLOCK] * BLOCK + positions % BLOCK
            real = ids[positions // BLOCK] != 0
            for name in group.layer_names:
                cache = self.caches[name]
                key, value = token_kv(LAYERS.index(name), tokens)
                halves = cache.view(cache.shape[0], HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
                isa = _get_attn_isa(torch.bfloat16, BLOCK, HEAD, "auto")
                ops.cpu_attn_reshape_and_cache(key[real], value[real], *halves, slots[real], isa)

    def rows(self, group: int, block_ids: list[int], tokens: range) -> torch.Tensor:
        """Bytes of the rows holding ``tokens`` in every layer of ``group``, read through the bound layout's
        planes."""
        from lmcache_platforms.kernels.contract import Direction, buffer_bytes
        from lmcache_platforms.kernels.torch_backend import TorchBackend
        from lmcache_platforms.layout.slots import rows_for_tokens, slot_mapping

        layout = self.worker.impl.layout
        (tg,) = [tg for tg in layout.transfer_groups if tg.group == group]
        kv_group = layout.group(group)  # in block rows where the layout moves whole block pages
        first = tokens.start // kv_group.tokens_per_row
        slots = slot_mapping(kv_group, block_ids, rows_for_tokens(tokens.stop, kv_group))[first:]
        buffer = torch.zeros(buffer_bytes(tg.planes, len(slots)), dtype=torch.uint8)
        TorchBackend().transfer(tg.planes, slots, buffer, Direction.STORE)
        return buffer

    def wait_for_loads(self, timeout: float = 60.0) -> None:
        """vLLM's steps while requests wait for their loads: nothing scheduled, loads started after the (empty)
        forward, outcomes taken from ``get_transfer_results`` and given to the scheduler side, until every
        waiting request is reported."""
        from vllm.v1.outputs import KVConnectorOutput

        from tests.integration.vllm_env import scheduler_output

        deadline = time.monotonic() + timeout
        while self.waiting:
            assert time.monotonic() < deadline, f"loads of {sorted(self.waiting)} never reported"
            self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(scheduler_output()))
            try:
                self.worker.start_load_kv(None)
                self.worker.wait_for_save()
                results = self.worker.get_transfer_results(set())
            finally:
                self.worker.clear_connector_metadata()
            assert results.failed_recving <= results.finished_recving
            self.scheduler.update_connector_output(KVConnectorOutput(
                finished_recving=results.finished_recving, failed_recving=results.failed_recving))
            self.finished_loads |= results.finished_recving
            self.failed_loads |= results.failed_recving
            self.waiting -= results.finished_recving
            if self.waiting:
                time.sleep(0.01)

    def step(self, scheduler_output: Any, write: dict[str, tuple[list[int], tuple[list[int], ...]]]) -> None:
        """One engine step: the loads of waiting requests first (as vLLM's earlier steps would), then metadata
        to the worker, a synchronous load, forward (writes K/V), save."""
        self.wait_for_loads()
        meta = self.scheduler.build_connector_meta(scheduler_output)
        self.worker.bind_connector_metadata(meta)
        try:
            if scheduler_output.has_sync_kv_loads:
                self.worker.start_load_kv(None)
            for tokens, block_ids in write.values():
                self.write_kv(tokens, block_ids)
            self.worker.wait_for_save()
        finally:
            self.worker.clear_connector_metadata()


def init_distributed(vllm_config: Any) -> None:
    """vLLM's process groups for one CPU rank (gloo), as its CPU worker sets them up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)


def destroy_distributed() -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def start_stack(vllm_config: Any, kv_cache_config: Any) -> Stack:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.layers.attention.attention import Attention

    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector

    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # what vLLM's engine core resolves for CPU attention
    names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    init_distributed(vllm_config)
    with set_current_vllm_config(vllm_config):
        for name in names:
            Attention(2, HEAD, HEAD**-0.5, num_kv_heads=HEADS, cache_config=vllm_config.cache_config, prefix=name)
        worker = LMCachePlatformsConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        caches = shared_buffer_caches(kv_cache_config.num_blocks, names)
        try:
            worker.register_kv_caches(caches)
        except BaseException:  # a stack that fails to start leaves nothing running
            worker.shutdown()
            destroy_distributed()
            raise
        scheduler = LMCachePlatformsConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    return Stack(vllm_config, kv_cache_config, caches, scheduler, worker)


def stop_stack(stack: Stack) -> None:
    # Worker first: the scheduler's lookup client terminates LMCache's shared ZMQ context, which blocks for
    # ever while the worker's offload server still has a socket on it.
    stack.worker.shutdown()
    stack.scheduler.shutdown()
    destroy_distributed()


def single_group_stack(model_dir: Any, **extra: Any) -> Iterator[Stack]:
    """A started stack for a model whose layers all form one full-attention group (hybrid manager off);
    stopped when the generator resumes (use as a fixture body: ``yield from single_group_stack(...)``).
    ``extra``: more ``kv_connector_extra_config`` entries."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    from lmcache_platforms.integration.vllm import health
    from tests.integration.specs import full, group
    from tests.integration.vllm_env import vllm_config

    config = KVCacheConfig(num_blocks=32, kv_cache_groups=[group(list(LAYERS), full())], kv_cache_tensors=[
        KVCacheTensor(size=1, layers=list(LAYERS), layer_stride=1, block_stride=1)])
    health.forget()
    stack = start_stack(vllm_config(model_dir, "LMCachePlatformsConnector", disable_hma=True, **extra), config)
    yield stack
    stop_stack(stack)
