"""Closing LMCache 0.5.6's asynchronous lookup client and server (its ``enable_async_loading``) without aborting
the process.

Each runs a thread blocked in ``recv`` on its PULL socket. Upstream's ``close`` clears ``running``, waits one
second for that thread (which never wakes: nothing more arrives), then closes the sockets and terminates the
context under it. A ZMQ socket belongs to one thread: libzmq then asserts (``pfd.revents & POLLIN``,
``signaler.cpp``) and the whole vLLM process aborts at shutdown. These wrappers first wake the thread with a
message it handles as a no-op (a lookup answer, or a clean-up, for a lookup id no request has), sent from a
socket of their own, so the thread sees ``running`` cleared and returns; upstream's ``close`` then joins it at
once and closes sockets no other thread uses. Where the PULL socket was bound is recorded when the object is
made (``wrap_client_init``, ``wrap_server_init``), from the same metadata upstream reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

WAKE_ID = "lmcache-platforms-close"
"""The lookup id of the waking message: never a request's."""
_ENDPOINT = "_lmcache_platforms_pull_endpoint"
_WAKE_TIMEOUT_S = 1.0


def _pull_endpoint(metadata: Any, service: str, rank: int) -> str:
    """The address upstream binds the PULL socket of ``service`` (``lookup_scheduler``, ``lookup_worker``) at."""
    from lmcache.v1.rpc_utils import get_zmq_rpc_path_lmcache

    rpc_port = (metadata.kv_connector_extra_config or {}).get("lmcache_rpc_port", 0)
    return f"ipc://{get_zmq_rpc_path_lmcache(metadata.engine_id, service, rpc_port, rank)}"


def wrap_client_init(upstream: Callable[..., None]) -> Callable[..., None]:
    """Patch-catalog wrapper of ``LMCacheAsyncLookupClient.__init__``: records where its PULL socket is bound."""

    def __init__(self: Any, config: Any, metadata: Any) -> None:
        setattr(self, _ENDPOINT, _pull_endpoint(metadata, "lookup_scheduler", 0))
        upstream(self, config, metadata)

    return __init__


def wrap_server_init(upstream: Callable[..., None]) -> Callable[..., None]:
    """Patch-catalog wrapper of ``LMCacheAsyncLookupServer.__init__``: records where its PULL socket is bound."""

    def __init__(self: Any, lmcache_engine: Any, metadata: Any) -> None:
        setattr(self, _ENDPOINT, _pull_endpoint(metadata, "lookup_worker", metadata.worker_id))
        upstream(self, lmcache_engine, metadata)

    return __init__


def wrap_client_close(upstream: Callable[[Any], None]) -> Callable[[Any], None]:
    """Patch-catalog wrapper of ``LMCacheAsyncLookupClient.close``: its thread woken by a lookup answer first."""

    def close(self: Any) -> None:
        from lmcache.v1.lookup_client.async_lookup_message import LookupResponseMsg

        _wake(self, LookupResponseMsg(lookup_id=WAKE_ID, num_hit_tokens=0))
        upstream(self)

    return close


def wrap_server_close(upstream: Callable[[Any], None]) -> Callable[[Any], None]:
    """Patch-catalog wrapper of ``LMCacheAsyncLookupServer.close``: its thread woken by a clean-up first."""

    def close(self: Any) -> None:
        from lmcache.v1.lookup_client.async_lookup_message import LookupCleanupMsg

        _wake(self, LookupCleanupMsg(lookup_id=WAKE_ID))
        upstream(self)

    return close


def _wake(owner: Any, message: Any) -> None:
    """Clear ``owner.running`` and send ``message`` to its PULL socket, then wait for its thread to return."""
    import msgspec
    import zmq

    owner.running = False
    thread, endpoint = getattr(owner, "thread", None), getattr(owner, _ENDPOINT, None)
    if thread is None or endpoint is None or not thread.is_alive():
        return
    socket = owner.ctx.socket(zmq.PUSH)
    try:
        socket.setsockopt(zmq.SNDTIMEO, int(_WAKE_TIMEOUT_S * 1000))
        socket.setsockopt(zmq.LINGER, int(_WAKE_TIMEOUT_S * 1000))
        socket.connect(endpoint)
        socket.send(msgspec.msgpack.encode(message))
    except zmq.ZMQError as exc:
        logger.warning("could not wake LMCache's async lookup thread at %s (%s): closing it may abort the process",
                       endpoint, exc)
    finally:
        socket.close()
    thread.join(_WAKE_TIMEOUT_S)
