"""What a running server shows a watcher: our families on ``/metrics`` and the KV events its ZMQ publisher sends."""

from __future__ import annotations

import re
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
