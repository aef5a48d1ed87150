"""What the remote-store tests share: engines that move chunks in parts, counts of the round trips a connector's
Redis client makes and of the thread hand-offs of the fs:// connector, and LMCache's own one-object-at-a-time
reads put back (the negative controls)."""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_platforms.connector.instance_adapter import adapt_engine
from lmcache_platforms.tools.engine import LayoutEngine
from lmcache_platforms.upstream_fixes.redis_socket_reads import SocketReader
from tests.upstream_originals import put_back

UPSTREAM_READ_PATHS = ("support_batched_get", "batched_get", "support_batched_contains", "batched_contains",
                       "_batched_async_contains", "._get")
"""The targets (by their ending) of the catalog's remote read patches: batched reads and lookups, checked reads."""


def parted(engine: LayoutEngine) -> LayoutEngine:
    """Chunks stored and loaded in parts, as the vLLM engine impl sets it up for a window model."""
    engine.connector.bind(engine.layout, split=True)
    adapt_engine(engine.engine, engine.connector.parts, engine.layout.chunk_size)
    return engine


def remote_connector(engine: LayoutEngine) -> Any:
    """LMCache's remote connector (Redis, Redis Cluster or fs://) of an engine, out of the wrapper that times it."""
    return engine.engine.storage_manager.storage_backends["RemoteBackend"].connection.getWrappedConnector()


def upstream_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache 0.5.6's remote read paths back for this test: every catalog patch of them restored to its
    original."""
    records = put_back(monkeypatch, lambda patch: patch.target.endswith(UPSTREAM_READ_PATHS)
                       and patch.replacement.split(":")[0].endswith(("redis_reads", "batched_remote")))
    assert len(records) == 8, [r.patch.target for r in records]


class RoundTrips:
    """The round trips a connector's Redis client makes from now on, each as the number of commands it carries:
    a single command is 1, a pipeline its length (one round trip; on a cluster, one per node holding some of its
    keys, sent together); with the load pipelines this package reads on its own connection
    (``redis_socket_reads``), also counted in ``socket_trips``. Counted on the real client and reader, whose
    behaviour is unchanged."""

    def __init__(self, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        client = getattr(connector, "cluster", None) or connector.connection
        self.trips: list[int] = []
        self.socket_trips: list[int] = []
        single, make_pipeline = client.execute_command, client.pipeline
        socket_read = SocketReader.read

        def read(reader: SocketReader, names: list[str], receive: Any) -> Any:
            self.trips.append(2 * len(names))
            self.socket_trips.append(2 * len(names))
            return socket_read(reader, names, receive)

        async def execute_command(*args: Any, **kwargs: Any) -> Any:
            self.trips.append(1)
            return await single(*args, **kwargs)

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make_pipeline(*args, **kwargs)
            run = pipe.execute

            async def execute(*run_args: Any, **run_kwargs: Any) -> Any:
                self.trips.append(len(pipe))
                return await run(*run_args, **run_kwargs)

            pipe.execute = execute
            return pipe

        monkeypatch.setattr(client, "execute_command", execute_command)
        monkeypatch.setattr(client, "pipeline", pipeline)
        monkeypatch.setattr(SocketReader, "read", read)

    def take(self) -> list[int]:
        """The round trips since the last take, then start again."""
        taken = self.trips[:]
        self.trips.clear()
        return taken


class HandOffs:
    """The jobs a connector's event loop hands to a thread from now on (``run_in_executor``: what ``aiofiles``
    does for every open, read and test of a file), counted on the real loop."""

    def __init__(self, connector: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        loop = connector.loop
        self.count = 0
        hand_off = loop.run_in_executor

        def run_in_executor(*args: Any) -> Any:
            self.count += 1
            return hand_off(*args)

        monkeypatch.setattr(loop, "run_in_executor", run_in_executor)

    def take(self) -> int:
        """The hand-offs since the last take, then start again."""
        taken, self.count = self.count, 0
        return taken
