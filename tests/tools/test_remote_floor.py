"""The Redis tier's floor in ``bench --engine``: how many objects of each part a request read, from our
load's line, and those objects read again from a real ``redis-server`` alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lmcache_platforms.tools.redis_server import RedisServer
from lmcache_platforms.tools.remote_floor import objects_read, read_ms
from tests.ci import missing

LINES = """\
lmcache_platforms INFO: request 1-a: read 5 objects (all: 4, reach64: 1) for 512 of 512 tokens, 9 bytes written, 1 ms
lmcache_platforms INFO: request 2-b: read 5 objects (all: 4, reach64: 1) for 511 of 511 tokens, 9 bytes written, 1 ms
lmcache_platforms INFO: request 3-c: read 4 objects (all: 3, reach64: 1) for 384 of 384 tokens, 9 bytes written, 1 ms
"""


def test_the_last_load_s_objects_per_part_are_read_off_its_line() -> None:
    assert objects_read(LINES) == {"all": 3, "reach64": 1}
    assert objects_read("INFO: request 3-c: read 3 objects (whole: 3) for 300 of 300 tokens") == {None: 3}
    with pytest.raises(ValueError, match="no load line"):
        objects_read("LMCache INFO: [req_id=3-c] Stored 300 out of total 300 tokens")


@pytest.fixture
def server(tmp_path: Path):
    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH (Debian package redis-server; scripts/test_services.sh installs it)")
    with RedisServer(str(tmp_path)) as running:
        yield running


@pytest.mark.redis
def test_the_floor_reads_as_many_objects_of_each_part_as_asked_and_no_other(server: RedisServer) -> None:
    """Objects as LMCache's remote backend names them (``<key>metadata`` and ``<key>kv_bytes``, the part a tag of
    the key): two parts of different sizes and whole-chunk objects. The bytes read are exactly the asked objects'
    (a part mixed up would read another size), and a part with fewer objects stored than asked is an error."""
    import redis

    sizes = {"lmcp_part%all": 1000, "lmcp_part%reach64": 3000, None: 7000}
    with redis.Redis(host="127.0.0.1", port=server.port) as client:
        for tag, size in sizes.items():
            for chunk in range(3):
                name = f"model@1@0@{chunk:04x}{size}@bfloat16" + (f"@lmcp_layout%x@{tag}" if tag else "")
                client.set(name + "metadata", b"m" * 28)
                client.set(name + "kv_bytes", bytes([chunk]) * size)
    ms, nbytes = read_ms(server.url, {"all": 3, "reach64": 1}, repeats=3)
    assert nbytes == 3 * 1000 + 3000 and ms > 0
    assert read_ms(server.url, {None: 2}, repeats=1)[1] == 2 * 7000
    with pytest.raises(ValueError, match="part reach64: 4 objects read by a request, 3 stored"):
        read_ms(server.url, {"reach64": 4}, repeats=1)
    with pytest.raises(ValueError, match="redis://host:port"):
        read_ms("redis-cluster://127.0.0.1:1", {None: 1})


@pytest.mark.redis
def test_the_bench_row_gets_the_floor_of_the_warm_pass_s_last_request_or_the_error(server: RedisServer) -> None:
    import redis

    from lmcache_platforms.tools.engine_bench import read_floor

    with redis.Redis(host="127.0.0.1", port=server.port) as client:
        for tag, size, count in (("all", 100, 4), ("reach64", 300, 1)):
            for chunk in range(count):
                client.set(f"m@1@0@{tag}{chunk}@bfloat16@lmcp_part%{tag}kv_bytes", b"x" * size)
                client.set(f"m@1@0@{tag}{chunk}@bfloat16@lmcp_part%{tag}metadata", b"m")
    row = read_floor(server.url, LINES)
    assert row["read_floor_bytes"] == 3 * 100 + 300 and row["read_floor_ms"] > 0
    more = LINES.replace("(all: 3, reach64: 1)", "(all: 8, reach64: 1)")
    assert read_floor(server.url, more) == {"read_floor_error": "ValueError: part all: 8 objects read by a request, "
                                                                "4 stored"}
