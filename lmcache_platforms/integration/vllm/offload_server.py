"""LMCache's ZMQ offload server with a close that cannot abort the process.

Upstream's ``close`` closes the REP socket from the caller's thread while the server thread is blocked in
``recv`` on it; ZMQ sockets are not thread-safe and libzmq aborts (``Fatal Python error: Aborted``). With
vLLM in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the usual CPU set-up) that kills or hangs every
shutdown. Here the thread is woken by a message it cannot decode (upstream logs that as one "Unexpected
error in offload server" line), sees ``running`` is off and returns; only then is its socket closed, from
the thread that now alone uses it.
"""

from __future__ import annotations

import os

import zmq
from lmcache.v1.offload_server.zmq_server import ZMQOffloadServer
from lmcache.v1.rpc_utils import get_zmq_rpc_path_lmcache, get_zmq_socket

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

WAKE = b"lmcache_platforms: stop"


class SafeCloseOffloadServer(ZMQOffloadServer):
    """``ZMQOffloadServer`` whose ``close`` stops the server thread before touching its socket."""

    def __init__(self, lmcache_engine, tp_rank: int) -> None:
        super().__init__(lmcache_engine, tp_rank)
        port = int(os.environ.get("LMCACHE_OFFLOAD_RPC_PORT", 100))
        engine_id = lmcache_engine.metadata.engine_id or "default"
        self._socket_path = get_zmq_rpc_path_lmcache(engine_id, "offload", port, tp_rank)

    def close(self) -> None:
        self.running = False
        if self.thread.is_alive():
            waker = get_zmq_socket(self.ctx, self._socket_path, "ipc", zmq.REQ, "connect")
            try:
                waker.setsockopt(zmq.SNDTIMEO, 1000)
                waker.send(WAKE)
                self.thread.join(timeout=5.0)
            except zmq.ZMQError as exc:
                logger.warning("could not wake LMCache's offload server thread: %s", exc)
            finally:
                waker.close(linger=0)
        if self.thread.is_alive():
            logger.warning("LMCache's offload server thread did not stop; leaving its socket open")
            return
        self.socket.close(linger=0)
