"""LMCache's ZMQ offload server with a close that cannot abort the process and a loop that always answers.

Upstream's ``close`` closes the REP socket from the caller's thread while the server thread is blocked in
``recv`` on it; ZMQ sockets are not thread-safe and libzmq aborts (``Fatal Python error: Aborted``). With
vLLM in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the usual CPU set-up) that kills or hangs every
shutdown. Here ``close`` wakes the thread with a message, the thread sees ``running`` is off and returns, and
only then is its socket closed, from the thread that now alone uses it.

Upstream's loop also answers nothing when a request cannot be decoded or its store raises: it logs
"Unexpected error in offload server" and goes back to ``recv``, which a REP socket refuses until it has
replied, so the thread ends and every later request waits for ever. Our wake-up message was such a request
(it logged "Expected `object`, got `int`" at every shutdown, whatever the storage). This loop answers every
request, with ``success=False`` when it is malformed or its store failed, and recognises the wake-up without
decoding it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import msgspec
import zmq
from lmcache.v1.offload_server.message import OffloadMsg, OffloadRetMsg
from lmcache.v1.offload_server.zmq_server import ZMQOffloadServer
from lmcache.v1.rpc_utils import get_zmq_context, get_zmq_rpc_path_lmcache, get_zmq_socket

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

WAKE = b"lmcache_platforms: stop"


class SafeCloseOffloadServer(ZMQOffloadServer):
    """``ZMQOffloadServer`` that answers every request and whose ``close`` stops the thread before touching its
    socket. Upstream's ``__init__`` is not called: it would start upstream's loop."""

    def __init__(self, lmcache_engine: Any, tp_rank: int) -> None:
        port = int(os.environ.get("LMCACHE_OFFLOAD_RPC_PORT", 100))
        engine_id = lmcache_engine.metadata.engine_id or "default"
        self._socket_path = get_zmq_rpc_path_lmcache(engine_id, "offload", port, tp_rank)
        self.ctx = get_zmq_context(use_asyncio=False)
        self.socket = get_zmq_socket(self.ctx, self._socket_path, "ipc", zmq.REP, "bind")
        self.lmcache_engine = lmcache_engine
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True, name="offload-server-thread")
        self.thread.start()

    def _serve(self) -> None:
        """Receive, answer, repeat; a message received after ``close`` started is its wake-up: return."""
        while self.running:
            try:
                frame = self.socket.recv()
                if not self.running:
                    return
                self.socket.send(msgspec.msgpack.encode(OffloadRetMsg(success=self._handle(frame))))
            except zmq.ZMQError as exc:
                if self.running:
                    logger.error("LMCache offload server stopped serving: %s", exc)
                return

    def _handle(self, frame: bytes) -> bool:
        """Store what an offload request names; False (never an exception) when it is malformed or fails."""
        try:
            request = msgspec.msgpack.decode(frame, type=OffloadMsg)
        except msgspec.DecodeError as exc:
            logger.warning("LMCache offload server: malformed request of %d bytes answered with failure: %s",
                           len(frame), exc)
            return False
        try:
            return bool(self.offload(request.hashes, request.slot_mapping, request.offsets))
        except Exception:
            logger.exception("LMCache offload server: storing %d chunks failed", len(request.hashes))
            return False

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
