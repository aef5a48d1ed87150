"""Every stored chunk object carries a checksum: a same-size corruption in any tier is refused before any byte of
it reaches the KV cache, the load reports no token, and the object is removed so the next lookup misses."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lmcache_platforms.connector import checksum
from lmcache_platforms.connector.binding import LayoutBinding
from lmcache_platforms.connector.checksum import ChecksumMismatch, tail_bytes
from lmcache_platforms.connector.chunk_format import ChunkFormat, paged_format
from lmcache_platforms.connector.instance_adapter import adapt_engine
from lmcache_platforms.connector.parts import part_configs
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from tests.ci import missing
from tests.kernels.crc_paths import check_against
from tests.layout.strategies import layout_specs

CHUNKS = 3


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=4096), st.data())
def test_any_single_flipped_byte_of_payload_or_trailer_is_caught(payload: bytes, data: st.DataObject) -> None:
    padding = data.draw(st.integers(0, 16))
    flat = torch.zeros(len(payload) + tail_bytes(len(payload)) + padding, dtype=torch.uint8)
    flat[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    checksum.seal([flat], len(payload))
    assert checksum.mismatched([flat], len(payload)) == []
    where = data.draw(st.integers(0, len(payload) + tail_bytes(len(payload)) - 1))
    flat[where] ^= data.draw(st.integers(1, 255))
    assert checksum.mismatched([flat], len(payload)) == [0]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3 * 4096), st.data())
def test_a_load_opens_an_object_only_when_its_whole_tail_is_intact(payload: int, data: st.DataObject) -> None:
    """``object_check`` takes the stripe table in one native call: any flipped byte of the table or trailer
    refuses the object; a flip in the payload passes the table and fails that stripe's check."""
    flat = torch.randint(0, 256, (payload + tail_bytes(payload),), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(payload))
    checksum.seal([flat], payload)
    check = checksum.object_check(flat, payload)
    assert check is not None and check.check(0, payload)
    assert torch.equal(check.expected, checksum.stripe_crcs([flat], payload)[0])
    where = data.draw(st.integers(0, flat.numel() - 1))
    flat[where] ^= data.draw(st.integers(1, 255))
    check = checksum.object_check(flat, payload)
    if where >= payload:
        assert check is None
    else:
        assert check is not None and not check.check(0, payload)
    assert checksum.object_check(flat[:-1], payload) is None  # no room for its trailer


def test_several_objects_opened_together_each_get_their_own_table_and_verdict() -> None:
    """``object_checks`` opens a load's objects from one allocation: each check holds its own object's CRCs and
    states, a refused object is None in its place, and a flipped payload byte fails only its own object."""
    torch.manual_seed(3)
    payload = 2 * checksum.STRIPE_BYTES + 17
    flats = [torch.randint(0, 256, (payload + tail_bytes(payload),), dtype=torch.uint8) for _ in range(5)]
    checksum.seal(flats, payload)
    flats[1][payload + 1] ^= 1  # its stripe table
    flats[3] = flats[3][:-1]  # no room for its trailer
    flats[4][5] ^= 1  # its payload: the table is intact
    checks = checksum.object_checks(flats, payload)
    assert [check is None for check in checks] == [False, True, False, True, False]
    for index in (0, 2, 4):
        assert torch.equal(checks[index].expected, checksum.stripe_crcs([flats[index]], payload)[0]) == (index != 4)
    assert [checks[index].check(0, payload) for index in (0, 2, 4)] == [True, True, False]
    with pytest.raises(ValueError, match=r"a checked load needs its object as a contiguous 1-D uint8 tensor in host "
                                         r"memory, got \(\d+,\) torch.uint8 on cpu"):
        checksum.object_checks([flats[0], torch.zeros(2 * flats[0].numel(), dtype=torch.uint8)[::2]], payload)


@pytest.mark.parametrize("strided", [False, True])
def test_a_load_checked_on_the_device_compares_its_crcs_with_the_carried_ones(strided: bool) -> None:
    """What a GPU load compares: the stripe CRCs each object carries (read from host memory while the chunks
    cross) against those the device computed. Intact objects pass (the negative control); a flipped CRC from the
    device names its object, and so does an object whose table fails its trailer; objects not at one address
    (strided views) read the same through tensor copies."""
    torch.manual_seed(5)
    payload = 2 * checksum.STRIPE_BYTES + 40
    size = payload + tail_bytes(payload)
    backing = torch.randint(0, 256, (4, 2 * size), dtype=torch.uint8)
    flats = [row[::2] if strided else row[:size] for row in backing]
    checksum.seal(flats, payload)
    computed = checksum.stripe_crcs(flats, payload)
    carried = checksum.carried_stripes(flats, payload)
    assert all(torch.equal(table, row) for table, row in zip(carried, computed, strict=True))
    assert checksum.differing(carried, computed) == []
    computed[2, 1] ^= 1 << 7
    assert checksum.differing(carried, computed) == [2]
    flats[1][payload + 3] ^= 1  # its stripe table: refused without looking at the payload
    carried = checksum.carried_stripes(flats, payload)
    assert [table is None for table in carried] == [False, True, False, False]
    assert checksum.differing(carried, computed) == [1, 2]


def test_an_object_in_strided_memory_is_sealed_and_read_the_same_as_a_contiguous_one() -> None:
    """Contiguous host objects are sealed and read at their address; any other view goes through tensor copies,
    with the same bytes either way."""
    torch.manual_seed(0)
    payload = 3 * checksum.STRIPE_BYTES + 5
    size = payload + tail_bytes(payload)
    contiguous = torch.randint(0, 256, (size,), dtype=torch.uint8)
    backing = torch.zeros(2 * size, dtype=torch.uint8)
    strided = backing[::2]
    strided.copy_(contiguous)
    checksum.seal([contiguous, strided], payload)
    assert torch.equal(strided, contiguous)
    assert bool((backing[1::2] == 0).all()), "sealing a strided view wrote between its bytes"
    assert torch.equal(checksum.stored_stripes(strided, payload), checksum.stored_stripes(contiguous, payload))
    assert checksum.mismatched([contiguous, strided], payload) == []
    strided[payload + 2] ^= 1
    assert checksum.stored_stripes(strided, payload) is None
    assert checksum.mismatched([contiguous, strided], payload) == [1]


def test_an_object_without_room_for_its_table_is_refused_and_left_unwritten() -> None:
    payload = checksum.STRIPE_BYTES + 1
    flat = torch.full((payload + tail_bytes(payload) - 1,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"an object of {flat.numel()} bytes has no room after its {payload}-byte "
                                         r"payload for the 8-byte stripe table and the trailer"):
        checksum.seal([flat], payload)
    assert bool((flat == 7).all())
    assert checksum.stored_stripes(flat, payload) is None


def test_sealing_with_stripe_crcs_for_fewer_objects_is_refused_and_writes_nothing() -> None:
    payload = checksum.STRIPE_BYTES
    flats = [torch.full((payload + tail_bytes(payload),), 7, dtype=torch.uint8) for _ in range(2)]
    stripes = checksum.stripe_crcs(flats[:1], payload)
    with pytest.raises(ValueError, match=r"^2 objects to seal, stripe CRCs for 1$"):
        checksum.seal(flats, payload, stripes)
    assert all(bool((flat == 7).all()) for flat in flats)


def test_a_flip_in_any_stripe_of_a_batch_names_only_its_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects of several stripes, hashed on several threads: each flip is pinned on its own object."""
    monkeypatch.setattr(checksum, "STRIPE_BYTES", 4096)
    torch.manual_seed(0)
    payload = 5 * 4096 + 123
    flats = [torch.randint(0, 256, (payload + tail_bytes(payload),), dtype=torch.uint8) for _ in range(4)]
    checksum.seal(flats, payload)
    assert checksum.mismatched(flats, payload) == []
    for index, where in ((1, 0), (3, 4 * 4096 + 7), (2, payload - 1)):
        flats[index][where] ^= 1
        assert checksum.mismatched(flats, payload) == [index]
        flats[index][where] ^= 1


def bound_request(spec, mode: str, backend: str, rng) -> tuple[ChunkFormat, LayoutBinding, list, dict]:
    """A layout drawn from ``spec`` bound on ``backend``, a request's chunk bounds and their store slots (the
    example is skipped when the layout moves nothing or the request fills no chunk)."""
    layout = materialize(spec, mode, seed=rng.randrange(2**16))
    assume(layout.transfer_groups)
    fmt = paged_format(layout)
    binding = LayoutBinding(layout, [fmt], backend)
    request = roundtrip.make_request(layout, spec.num_tokens, seed=rng.randrange(2**16))
    bounds = request.chunks(layout.chunk_size, request.stored_tokens)
    assume(bounds)
    return fmt, binding, bounds, binding.chunk_slots(fmt, request.store_ids, *zip(*bounds, strict=True))


@settings(max_examples=25, deadline=None)
@given(layout_specs(every_group=True, min_chunks=1), st.sampled_from(["bundled", "exploded"]),
       st.sampled_from(["cpu", "torch"]), st.randoms(use_true_random=False))
def test_a_whole_chunk_store_hashes_what_it_writes(spec, mode, backend, rng) -> None:
    """Into host objects, a whole-chunk store hashes the bytes it writes into one stripe state per object (the
    cpu backend inside its copy loops, `torch` right after its copy), and `seal` writes from them the trailer a
    pass over the finished objects writes. Negative control: a byte changed between the store and the seal is
    not in those stripes, so that object fails its check."""
    fmt, binding, bounds, slots = bound_request(spec, mode, backend, rng)
    hosts = [torch.zeros(fmt.nbytes, dtype=torch.uint8) for _ in bounds]
    stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=True)
    binding.store_chunks(fmt, hosts, slots, stripes=stripes)
    assert stripes.states is not None and len(stripes.states) == len(hosts) and stripes.room is None
    passed = [host.clone() for host in hosts]
    stripes.seal(hosts)
    checksum.seal(passed, fmt.payload_bytes)
    assert all(torch.equal(a, b) for a, b in zip(hosts, passed, strict=True))
    assert checksum.mismatched(hosts, fmt.payload_bytes) == []

    changed = rng.randrange(len(hosts))
    stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=True)
    binding.store_chunks(fmt, hosts, slots, stripes=stripes)
    hosts[changed][rng.randrange(fmt.payload_bytes)] ^= 0x10
    stripes.seal(hosts)
    assert checksum.mismatched(hosts, fmt.payload_bytes) == [changed]


def test_an_unsealed_object_is_not_intact() -> None:
    """An object written without a trailer (all zeros where it belongs) never passes."""
    assert checksum.mismatched([torch.zeros(64 + tail_bytes(64), dtype=torch.uint8)], 64) == [0]


def _planes(layout) -> list[torch.Tensor]:
    return [p.storage.clone() for p in roundtrip.all_planes(layout)]


def _chunk_keys(engine: LayoutEngine, tokens: list[int], configs: dict[str, str]) -> list[Any]:
    return [key for _, _, key in engine.engine.token_database.process_tokens(
        tokens=torch.tensor(tokens), request_configs=configs)]


def _flip_cpu(engine: LayoutEngine, key: Any) -> Callable[[], bool]:
    """Flip one byte of ``key``'s object in LMCache's CPU cache; returns whether it is still cached."""
    hot = engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache
    flat = hot[key].tensor.reshape(-1).view(torch.uint8)
    flat[flat.numel() // 3] ^= 0x5A
    return lambda: key in hot


def _flip_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x5A
    path.write_bytes(bytes(data))


class Tier:
    """One LMCache tier our chunks are read from, and how to flip a byte of a stored object in it."""

    def __init__(self, name: str, tmp_path: Path) -> None:
        self.name, self.dir = name, tmp_path / "store"
        self.dir.mkdir()
        self.redis: Any = None

    def storage(self, layout) -> StorageOptions:
        size = cache_size_gib(layout, CHUNKS * layout.chunk_size)
        if self.name == "cpu":
            return StorageOptions(max_local_cpu_size=size)
        if self.name == "disk":
            return StorageOptions(local_cpu=False, max_local_cpu_size=size, local_disk=str(self.dir),
                                  max_local_disk_size=size)
        if self.name == "fs":
            return StorageOptions(local_cpu=False, max_local_cpu_size=size, remote_url=f"fs://localhost:0{self.dir}")
        return StorageOptions(local_cpu=False, max_local_cpu_size=size, remote_url=self.redis.url)

    @property
    def location(self) -> str:
        return {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend"}.get(self.name, "RemoteBackend")

    def flip(self, engine: LayoutEngine, key: Any) -> Callable[[], bool]:
        """Flip one byte of ``key``'s object; returns whether the object is still in the tier."""
        name = key.to_string()
        if self.name == "cpu":
            return _flip_cpu(engine, key)
        if self.name == "redis":
            import redis

            client = redis.Redis.from_url(self.redis.url)
            value = bytearray(client.get(name + "kv_bytes"))
            value[len(value) // 3] ^= 0x5A
            client.set(name + "kv_bytes", bytes(value))  # same length: only a checksum tells it apart
            return lambda: bool(client.exists(name + "metadata") or client.exists(name + "kv_bytes"))
        path = (self.dir / (name.replace("/", "-") + ".pt") if self.name == "disk"
                else self.dir / (name.replace("/", "-SEP-") + ".data"))
        assert path.is_file(), sorted(p.name for p in self.dir.iterdir())
        _flip_file(path)
        return path.exists


@pytest.fixture(params=["cpu", "disk", "fs", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path, closable_remote_backends: None):
    tier = Tier(request.param, tmp_path)
    if tier.name != "redis":
        yield tier
        return
    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH")
    from lmcache_platforms.tools.redis_server import RedisServer

    with RedisServer(str(tmp_path)) as server:
        tier.redis = server
        yield tier


def _stored_engine(layout, tier: Tier, request: roundtrip.Request) -> LayoutEngine:
    engine = LayoutEngine(layout, tier.storage(layout))
    engine.store(request.tokens, request.store_ids)
    assert engine.wait_stored(request.tokens, request.stored_tokens, search_range=[tier.location]) == \
        request.stored_tokens
    return engine


def _rows_of(layout) -> list[torch.Tensor]:
    return [p.rows_view().reshape(p.geometry.num_slots, -1).clone() for p in roundtrip.all_planes(layout)]


def assert_only_checked_rows(layout, intact: list[torch.Tensor]) -> None:
    """After a refused load into zeroed planes, each row is untouched (zeros) or holds what the intact load wrote
    there (``intact``, ``_rows_of``): no byte that failed its check reached the KV cache."""
    for plane, now, good in zip(roundtrip.all_planes(layout), _rows_of(layout), intact, strict=True):
        wrong = ~((now == 0).all(dim=1) | (now == good).all(dim=1))
        assert not wrong.any(), f"plane {plane.name!r} of {plane.layer!r}: rows {wrong.nonzero().flatten().tolist()}"


def test_a_flipped_byte_in_any_tier_is_refused_removed_and_then_missed(tier: Tier) -> None:
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=21)
    request = roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=21)
    with _stored_engine(layout, tier, request) as engine:
        roundtrip.zero_planes(layout)
        assert engine.retrieve(request.tokens, request.load_ids) == request.stored_tokens
        intact = _rows_of(layout)
        key = _chunk_keys(engine, request.tokens, engine.tags)[1]
        still_there = tier.flip(engine, key)
        roundtrip.zero_planes(layout)
        loaded = engine.connector.binding.counters.chunks_loaded
        # Hashed as it was copied, chunk 1 failed once its bytes were in the KV cache: the whole load reports no
        # token (vLLM recomputes over the rows) and chunk 1's rows were zeroed, so every row is intact or zero.
        assert engine.retrieve(request.tokens, request.load_ids) == 0
        assert_only_checked_rows(layout, intact)
        assert engine.connector.binding.counters.chunks_loaded == loaded
        assert not still_there()
        assert engine.engine.storage_manager.contains(key) is None
        assert engine.lookup(request.tokens) == layout.chunk_size  # the chunks before it still hit
        assert engine.retrieve(request.tokens[: layout.chunk_size], request.load_ids) == layout.chunk_size


def _accepting_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks made to pass: stripes compared with the object's own bytes, whatever its table says."""
    monkeypatch.setattr(checksum, "mismatched", lambda flats, payload_bytes: [])
    monkeypatch.setattr(checksum, "unverified", lambda hashing, tables: [])
    monkeypatch.setattr(checksum, "object_checks", lambda flats, payload_bytes: [check_against(
        flat, payload_bytes, checksum.STRIPE_BYTES, checksum.stripe_crcs([flat], payload_bytes)[0]) for flat in flats])


def test_without_verification_the_same_corruption_is_loaded(tier: Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the check accepting everything, the flipped object loads as a hit with wrong KV,
    which both oracles above see (wrong rows written; a hit)."""
    _accepting_everything(monkeypatch)
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=21)
    request = roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=21)
    stored = roundtrip.snapshot(layout, request)
    with _stored_engine(layout, tier, request) as engine:
        roundtrip.zero_planes(layout)
        assert engine.retrieve(request.tokens, request.load_ids) == request.stored_tokens
        intact = _rows_of(layout)
        tier.flip(engine, _chunk_keys(engine, request.tokens, engine.tags)[1])
        roundtrip.zero_planes(layout)
        hit = engine.retrieve(request.tokens, request.load_ids)
        verdict = roundtrip.verify(layout, request, stored, hit)
        with pytest.raises(AssertionError, match="rows"):
            assert_only_checked_rows(layout, intact)
    assert hit == request.stored_tokens
    assert not verdict.bit_exact and verdict.mismatched_rows >= 1


@pytest.mark.parametrize(("part", "chunk", "hit_chunks"), [("all", 0, 0), ("reach32", CHUNKS - 1, CHUNKS - 1)])
def test_each_chunk_part_carries_its_own_checksum(part: str, chunk: int, hit_chunks: int) -> None:
    """Window-only parts: a corrupt part fails the load and is removed; the parts of other chunks stay."""
    layout = materialize(load_layout_spec("gemma3"), seed=5)
    request = roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=5)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, CHUNKS * layout.chunk_size))
    with LayoutEngine(layout, storage) as engine:
        engine.connector.bind(layout, split=True)
        adapt_engine(engine.engine, engine.connector.parts, layout.chunk_size)
        engine.store(request.tokens, request.store_ids)
        chosen = next(p for p in engine.connector.parts if p.name == part)
        key = _chunk_keys(engine, request.tokens, part_configs(engine.tags, chosen))[chunk]
        _flip_cpu(engine, key)
        roundtrip.zero_planes(layout)
        assert engine.retrieve(request.tokens, request.load_ids) == 0
        assert engine.engine.storage_manager.contains(key) is None
        assert engine.lookup(request.tokens) == hit_chunks * layout.chunk_size


def test_a_bare_engine_retrieve_raises_rather_than_load_a_corrupt_object() -> None:
    """Through LMCache's own retrieve (the path of the modes where LMCache's engine brings the objects itself), a
    mismatch raises, and the rows the corrupt object's load wrote are zero again (the object is the load's only
    one: the KV cache is as before)."""
    layout = materialize(load_layout_spec("llama"), seed=3)
    request = roundtrip.make_request(layout, layout.chunk_size, seed=3)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, layout.chunk_size))
    with LayoutEngine(layout, storage) as engine:
        engine.store(request.tokens, request.store_ids)
        (key,) = _chunk_keys(engine, request.tokens, engine.tags)
        _flip_cpu(engine, key)
        roundtrip.zero_planes(layout)
        before = _planes(layout)
        bare = engine.engine.retrieve
        with pytest.raises(ChecksumMismatch, match=r"chunk \[0, 64\) fails its checksum"):
            bare(torch.tensor(request.tokens), block_ids=request.load_ids, request_configs=engine.tags)
        assert all(torch.equal(a, b) for a, b in zip(before, _planes(layout), strict=True))


def test_without_the_native_library_zlib_stands_in_under_another_format(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback still catches flips, and its objects never share keys with the native checksum's."""
    native_version = checksum.format_version()
    monkeypatch.setattr(checksum, "native", lambda: None)
    assert checksum.format_version() != native_version
    torch.manual_seed(1)
    payload = 3 * checksum.STRIPE_BYTES + 5
    flats = [torch.randint(0, 256, (payload + tail_bytes(payload),), dtype=torch.uint8) for _ in range(3)]
    checksum.seal(flats, payload)
    assert checksum.mismatched(flats, payload) == []
    flats[2][checksum.STRIPE_BYTES + 1] ^= 0x80
    assert checksum.mismatched(flats, payload) == [2]


def test_any_flipped_byte_of_a_stored_object_is_refused_by_the_engine() -> None:
    """Through a real engine: whichever byte of the payload, stripe table or trailer of a cached chunk object
    flips, the load reports no token, the KV cache holds no byte that failed its check, and the object is gone;
    stored again, it loads bit for bit."""
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=8)
    request = roundtrip.make_request(layout, layout.chunk_size, seed=8)
    stored = roundtrip.snapshot(layout, request)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, layout.chunk_size))
    original = _planes(layout)

    def restored() -> None:
        for plane, saved in zip(roundtrip.all_planes(layout), original, strict=True):
            plane.storage.copy_(saved)

    with LayoutEngine(layout, storage) as engine:
        payload = engine.connector.fmt.payload_bytes
        engine.store(request.tokens, request.store_ids)
        roundtrip.zero_planes(layout)
        assert engine.retrieve(request.tokens, request.load_ids) == layout.chunk_size
        intact = _rows_of(layout)

        @settings(max_examples=25, deadline=None)
        @given(st.integers(0, payload + tail_bytes(payload) - 1), st.integers(1, 255))
        def flipped(where: int, bits: int) -> None:
            restored()
            engine.store(request.tokens, request.store_ids)
            (key,) = _chunk_keys(engine, request.tokens, engine.tags)
            hot = engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache
            hot[key].tensor.reshape(-1).view(torch.uint8)[where] ^= bits
            roundtrip.zero_planes(layout)
            assert engine.retrieve(request.tokens, request.load_ids) == 0
            assert_only_checked_rows(layout, intact)
            assert key not in hot and engine.lookup(request.tokens) == 0

        flipped()
        restored()
        engine.store(request.tokens, request.store_ids)
        roundtrip.zero_planes(layout)
        hit = engine.retrieve(request.tokens, request.load_ids)
        assert roundtrip.verify(layout, request, stored, hit).bit_exact and hit == layout.chunk_size


@pytest.mark.parametrize("scrubbed", [True, False], ids=["scrubbed", "planted-no-scrub"])
def test_a_flip_in_the_last_stripe_of_the_last_object_fails_the_load(scrubbed: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The load hashes as it copies and decides at the end: a flip in the last payload byte of the last object
    of a load (the last bytes hashed) still fails it whole, its rows are zeroed, and only that object is removed.
    Negative control: with the zeroing planted away, the rows oracle sees the corrupt bytes."""
    from lmcache_platforms.connector.binding import LayoutBinding

    if not scrubbed:
        monkeypatch.setattr(LayoutBinding, "_scrub", lambda self, fmt, slots, corrupt: None)
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=12)
    request = roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=12)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, CHUNKS * layout.chunk_size))
    with LayoutEngine(layout, storage) as engine:
        payload = engine.connector.fmt.payload_bytes
        engine.store(request.tokens, request.store_ids)
        roundtrip.zero_planes(layout)
        assert engine.retrieve(request.tokens, request.load_ids) == request.stored_tokens
        intact = _rows_of(layout)
        key = _chunk_keys(engine, request.tokens, engine.tags)[-1]
        hot = engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache
        hot[key].tensor.reshape(-1).view(torch.uint8)[payload - 1] ^= 0x01
        roundtrip.zero_planes(layout)
        assert engine.retrieve(request.tokens, request.load_ids) == 0
        if scrubbed:
            assert_only_checked_rows(layout, intact)
        else:
            with pytest.raises(AssertionError, match="rows"):
                assert_only_checked_rows(layout, intact)
        assert key not in hot
        assert engine.lookup(request.tokens) == (CHUNKS - 1) * layout.chunk_size
