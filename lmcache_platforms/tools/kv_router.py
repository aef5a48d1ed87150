"""A KV-aware router in a few lines: it follows each server's KV events (vLLM's ZMQ publisher, ``--kv-events-config``)
and sends a prompt to the server whose published blocks hold the longest prefix of it (ties: the server that got
the fewest prompts). What a real router (llm-d, Dynamo, vLLM's production stack) does with the events, small
enough to read; used by the routing test and shown in the README.

Blocks are matched by their parent's hash and their token ids, as published, so the router needs no hash function
of its own; it ignores the events' extra keys (LoRA adapter, ``cache_salt``), which a real router folds in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


@dataclass
class PrefixIndex:
    """One server's published blocks: (parent hash, block tokens) -> block hash."""

    blocks: dict[tuple[Any, tuple[int, ...]], Any] = field(default_factory=dict)
    block_size: int | None = None

    def apply(self, event: Any) -> None:
        if isinstance(event, AllBlocksCleared):
            self.blocks.clear()
        elif isinstance(event, BlockRemoved):
            gone = set(event.block_hashes)
            self.blocks = {key: value for key, value in self.blocks.items() if value not in gone}
        elif isinstance(event, BlockStored) and len(event.block_hashes) * event.block_size == len(event.token_ids):
            # (vLLM's own sliding-window groups publish only the hashes of their window: not a prefix.)
            self.block_size = event.block_size
            parent = event.parent_block_hash
            for index, block_hash in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[index * event.block_size:(index + 1) * event.block_size])
                self.blocks[(parent, tokens)] = block_hash
                parent = block_hash

    def cached_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` the published blocks hold."""
        if self.block_size is None:
            return 0
        parent, cached = None, 0
        while cached + self.block_size <= len(tokens):
            parent = self.blocks.get((parent, tuple(tokens[cached:cached + self.block_size])))
            if parent is None:
                break
            cached += self.block_size
        return cached


class KVRouter:
    """Subscribes to every server's event endpoint and routes prompts; ``close`` stops the subscribers."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._indexes = {name: PrefixIndex() for name in endpoints}
        self._routed = dict.fromkeys(endpoints, 0)
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._follow, args=(name, endpoint), daemon=True,
                                          name=f"kv-router-{name}") for name, endpoint in endpoints.items()]
        for thread in self._threads:
            thread.start()

    def _follow(self, name: str, endpoint: str) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        with self._context.socket(zmq.SUB) as socket:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                _topic, _seq, payload = socket.recv_multipart()
                with self._lock:
                    for event in decoder.decode(payload).events:
                        self._indexes[name].apply(event)

    def cached_tokens(self, name: str, tokens: list[int]) -> int:
        with self._lock:
            return self._indexes[name].cached_tokens(tokens)

    def route(self, tokens: list[int]) -> tuple[str, int]:
        """The server for ``tokens`` and how many of them it holds."""
        with self._lock:
            best = max(self._indexes, key=lambda name: (self._indexes[name].cached_tokens(tokens),
                                                        -self._routed[name]))
            self._routed[best] += 1
            return best, self._indexes[best].cached_tokens(tokens)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._context.term()
