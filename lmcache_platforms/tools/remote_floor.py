"""The floor of a Redis tier's load in ``bench --engine``: one request's objects read back from the same store,
in one pipeline on a plain connection into buffers allocated beforehand, and nothing else (no LMCache, no
checksum, no scatter into the KV cache). What the store and the socket cost by themselves: a tier's
``load_ms`` minus this is what LMCache and our connector add.

Which objects, and how many of each chunk part, come from the loading pass's log line of each load
(``connector.chunk_loads``: ``request <id>: read <n> objects (<part>: <count>, ...)``); any stored objects of a
part are as large as the ones the request read, since a part's objects all have one shape.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Mapping
from urllib.parse import urlparse

from lmcache_platforms.connector.parts import PART_TAG, WHOLE
from lmcache_platforms.upstream_fixes.redis_socket_reads import Endpoint, SocketReader

READ = re.compile(r"request (\S+): read \d+ objects \(([^)]*)\)")
_PART_KEY_TAG = PART_TAG.removeprefix("lmcache.tag.") + "%"
_BYTES = "kv_bytes"


def objects_read(log: str) -> dict[str | None, int]:
    """How many objects of each part (None: chunks stored whole) the last load in ``log`` read."""
    loads = list(READ.finditer(log))
    if not loads:
        raise ValueError("the log has no load line (\"request ...: read N objects\"): nothing was loaded")
    counts: dict[str | None, int] = {}
    for entry in filter(None, loads[-1].group(2).split(", ")):
        name, count = entry.split(": ")
        counts[None if name == WHOLE else name] = int(count)
    return counts


def _part_of(name: str) -> str | None:
    return next((tag.removeprefix(_PART_KEY_TAG) for tag in name.split("@") if tag.startswith(_PART_KEY_TAG)),
                None)


def read_ms(url: str, objects: Mapping[str | None, int], repeats: int = 10) -> tuple[float, int]:
    """The median time in ms of reading ``objects[part]`` stored objects of each part (their ``metadata`` and
    ``kv_bytes`` values, as a load reads them) from the ``redis://`` store at ``url`` in one pipeline, and the
    bytes of the ``kv_bytes`` values read."""
    import redis

    where = urlparse(url)
    if where.scheme != "redis" or where.hostname is None or where.port is None:
        raise ValueError(f"a floor is read from a redis://host:port store, not {url!r}")
    with redis.Redis(host=where.hostname, port=where.port) as client:
        stored: dict[str | None, list[str]] = {}
        for key in client.scan_iter(match=f"*{_BYTES}", count=1000):
            name = key.decode().removesuffix(_BYTES)
            stored.setdefault(_part_of(name), []).append(name)
        names: list[str] = []
        for part, count in objects.items():
            held = sorted(stored.get(part, []))
            if len(held) < count:
                raise ValueError(f"part {part}: {count} objects read by a request, {len(held)} stored")
            names += held[:count]
        lengths = [int(client.strlen(name + _BYTES)) for name in names]
    buffers = [bytearray(length) for length in lengths]
    reader = SocketReader(Endpoint(where.hostname, where.port))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        received = reader.read(names, lambda index, _metadata, length: memoryview(buffers[index])[:length])
        times.append(time.perf_counter() - started)
        if not all(r.metadata is not None and r.kv_held for r in received):
            raise ValueError("an object went from the store while its floor was read")
    return statistics.median(times) * 1e3, sum(lengths)
