"""What a running server shows a watcher: our families on ``/metrics`` and the KV events its ZMQ publisher sends."""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

from lmcache_platforms.tools.demo.server import http_get

PREFIX = "vllm:lmcache_platforms_"


def scrape(base_url: str) -> dict[str, float]:
    """Our families' samples (summed over label sets) by sample name, without the ``_created`` timestamps and
    histogram buckets."""
    found: dict[str, float] = {}
    for line in http_get(f"{base_url}/metrics").splitlines():
        match = re.match(rf"^({re.escape(PREFIX)}\w+)(?:\{{[^}}]*\}})? (\S+)$", line)
        if match and not match.group(1).endswith(("_created", "_bucket")):
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


def scrape_by_label(base_url: str, family: str, label: str) -> dict[str, float]:
    """One family's samples by the value of one of their labels."""
    found: dict[str, float] = {}
    for line in http_get(f"{base_url}/metrics").splitlines():
        match = re.match(rf'^{re.escape(PREFIX + family)}\{{[^}}]*\b{label}="([^"]*)"[^}}]*\}} (\S+)$', line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


def receive(subscriber: zmq.Socket, until: Any, timeout_ms: int = 60_000) -> list[Any]:
    """Events from the publisher until ``until(events)`` holds (or the time-out, which fails the test)."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events: list[Any] = []
    while not until(events):
        if not subscriber.poll(timeout_ms):
            raise AssertionError(f"no KV event for {timeout_ms} ms; so far: {events}")
        _topic, _seq, payload = subscriber.recv_multipart()
        events.extend(decoder.decode(payload).events)
    return events


def replayed(endpoint: str, until: Any, timeout_s: float = 60.0) -> list[KVEventBatch]:
    """Every batch a publisher has sent, asked of its replay socket (``replay_endpoint``) from sequence 0 until
    ``until(batches)`` holds (or the time-out, which fails the test). Unlike a subscription, a replay cannot
    miss what was published before the subscriber joined."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    deadline = time.monotonic() + timeout_s
    with zmq.Context() as context, context.socket(zmq.DEALER) as replay:
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(endpoint)
        while True:
            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = []
            while True:
                if not replay.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise AssertionError(f"no replay from {endpoint} in {timeout_s} s")
                _empty, _topic, seq, payload = replay.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) < 0:  # the end of the replay
                    break
                batches.append(decoder.decode(payload))
            if until(batches):
                return batches
            if time.monotonic() > deadline:
                raise AssertionError(f"{endpoint} replayed only {batches} in {timeout_s} s")
            time.sleep(0.2)
