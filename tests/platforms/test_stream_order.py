"""The connector's device protocol on XPU and NPU, through a real store and load of a real ``LMCacheEngine``.

The planes are CPU tensors that the fake runtime claims as accelerator memory (``platform_for`` answers
the accelerator platform), so the kernels really run, on CPU, while every stream, event and copy request
goes to the recording fake. What the log must show, per direction:

- store: the store stream first waits for the compute stream (the forward's writes), the kernels fill the
  store scratch with every chunk of the batch ON the store stream, then one non-blocking copy per chunk takes
  its part of the scratch to its MemoryObj, still on the store stream; the store stream is synchronized before
  LMCache gets the MemoryObjs; the KV cache is never written;
- load: each chunk is copied MemoryObj -> its part of the load scratch on the load stream, then the kernels
  write the KV cache from it on the load stream; then an event recorded on the load stream is waited on by
  the compute stream
  (it must not read rows before they land) and the load stream is synchronized (LMCache frees the
  MemoryObjs next); the two directions never share a scratch buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmcache_platforms.connector import binding as binding_module
from lmcache_platforms.connector import checksum
from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.connector.layer_gate import LayerGate
from lmcache_platforms.kernels.contract import Direction
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.platforms import cpu as cpu_platform
from lmcache_platforms.platforms import npu as npu_platform
from lmcache_platforms.platforms import xpu as xpu_platform
from lmcache_platforms.platforms.base import Platform
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from tests.platforms.fake_runtime import Entry, FakeDeviceRuntime, FakeStream

pytestmark = pytest.mark.slow


@pytest.fixture(params=["xpu", "npu"])
def accelerator(request, monkeypatch) -> Iterator[tuple[Platform, FakeDeviceRuntime]]:
    """A fresh platform object whose runtime module is the fake, and the fake; the connector's binding sees
    every plane's memory as that platform's. ``torch.xpu`` itself stays real: LMCache and torch's own
    device probing must not see an accelerator (their device layers are not what is tested here)."""
    runtime = FakeDeviceRuntime(1, "fake accelerator")
    platform = {"xpu": xpu_platform.XpuPlatform, "npu": npu_platform.NpuPlatform}[request.param]()
    platform._module = lambda: runtime  # type: ignore[method-assign]
    monkeypatch.setattr(binding_module, "platform_for", lambda device: platform)
    yield platform, runtime


def tagger(layout: KVLayout, engine: LayoutEngine):
    """Names the memory a write lands in: the KV planes, each direction's scratch, the MemoryObjs' buffer."""
    kv = {p.storage.untyped_storage().data_ptr() for p in roundtrip.all_planes(layout)}
    host = engine.engine.storage_manager.local_cpu_backend.memory_allocator.buffer.untyped_storage().data_ptr()
    scratch = engine.connector.binding.scratch

    def tag(tensor: torch.Tensor) -> str | None:
        ptr = tensor.untyped_storage().data_ptr()
        for direction, buffer in scratch.items():
            if buffer._buffer is not None and buffer._buffer.untyped_storage().data_ptr() == ptr:
                return f"scratch.{direction.value}"
        return "kv" if ptr in kv else "host" if ptr == host else None

    return tag


def device_steps(log: list[Entry]) -> list[Entry]:
    """The log as a device queue would hold it: stream and event calls as they are, each kernel launch's
    reads and writes folded into ``("kernel", stream, read, written)``, copies as ``("copy", stream, source,
    target, non_blocking)``."""
    out: list[Entry] = []
    for entry in log:
        if entry[0] == "write" and entry[2] == "copy_":
            out.append(("copy", entry[1], entry[4][0] if entry[4] else None, entry[3], entry[5]))
            continue
        if entry[0] in ("read", "write"):
            read = frozenset(entry[3]) if entry[0] == "read" else frozenset(entry[4])
            written = frozenset({entry[3]}) if entry[0] == "write" else frozenset()
            if out and out[-1][0] == "kernel" and out[-1][1] == entry[1]:
                read, written = read | out[-1][2], written | out[-1][3]
                out.pop()
            out.append(("kernel", entry[1], read, written))
            continue
        out.append(entry)
    return out


def kernel(stream: str, source: str, target: str) -> Entry:
    return ("kernel", stream, frozenset({source}), frozenset({target}))


def expected_store(store: str, chunks: int) -> list[Entry]:
    """The batch's rows gathered into the scratch, then each chunk's part copied to its host object, on the
    store stream; once that stream is synchronized, each object's checksum trailer is written on the host
    (sealed only when its bytes are final)."""
    gather, copy = kernel(store, "kv", "scratch.store"), ("copy", store, "scratch.store", "host", True)
    return [("wait_stream", store, "default"), ("enter", store), gather, *[copy] * chunks, ("exit", store),
            ("stream_synchronize", store), ("seal", "default", chunks)]


def expected_load(load: str, chunks: int, event: str) -> list[Entry]:
    copy, scatter = ("copy", load, "host", "scratch.load", True), kernel(load, "scratch.load", "kv")
    return [("enter", load), *[copy] * chunks, scatter, ("exit", load), ("record", event, load),
            ("wait_event", "default", event), ("stream_synchronize", load)]


@pytest.mark.parametrize(("name", "tokens"), [("gemma3", 192), ("deepseek-v4-small", None)])
def test_store_and_load_order_of_waits_records_and_copies(accelerator, name: str, tokens: int | None) -> None:
    platform, runtime = accelerator
    spec = load_layout_spec(name)
    layout = materialize(spec, "bundled", seed=11)
    num_tokens = tokens or spec.num_tokens
    request = roundtrip.make_request(layout, num_tokens, seed=2)
    chunks = len(request.chunks(layout.chunk_size, request.stored_tokens))
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, num_tokens))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        binding = engine.connector.binding
        store, load = engine.connector.store_stream, engine.connector.load_stream
        assert isinstance(store, FakeStream) and isinstance(load, FakeStream) and store is not load
        assert binding.streams.platform is platform and binding.scratch.keys() == set(Direction)
        store_log, load_log, verdict = _watched_round_trip(layout, request, engine, runtime)
    assert verdict.bit_exact, verdict.problems
    assert store_log == expected_store(store.name, chunks)
    events = [entry[1] for entry in load_log if entry[0] == "record"]
    assert len(events) == 1
    assert load_log == expected_load(load.name, chunks, events[0])
    assert binding.scratch[Direction.STORE]._buffer.data_ptr() != binding.scratch[Direction.LOAD]._buffer.data_ptr()


def test_a_batch_larger_than_the_scratch_moves_a_scratch_full_at_a_time(accelerator, monkeypatch) -> None:
    """With room for three chunks, each launch moves three chunks (the last batch one), and each batch's copies
    are queued before the next batch's kernels overwrite the one scratch, on the same stream."""
    _, runtime = accelerator
    spec = load_layout_spec("deepseek-v4-small")
    layout = materialize(spec, "bundled", seed=11)
    request = roundtrip.make_request(layout, spec.num_tokens, seed=2)
    chunks = len(request.chunks(layout.chunk_size, request.stored_tokens))
    assert chunks == 4
    monkeypatch.setattr(binding_module, "BATCH_SCRATCH_BYTES", 3 * paged_format(layout).payload_bytes + 1)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, spec.num_tokens))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        store, load = engine.connector.store_stream.name, engine.connector.load_stream.name
        store_log, load_log, verdict = _watched_round_trip(layout, request, engine, runtime)
        assert engine.connector.binding.scratch[Direction.STORE]._buffer.numel() == 3 * paged_format(
            layout).payload_bytes
    assert verdict.bit_exact, verdict.problems
    gather, copy_out = kernel(store, "kv", "scratch.store"), ("copy", store, "scratch.store", "host", True)
    assert store_log[2:-3] == [gather, copy_out, copy_out, copy_out, gather, copy_out]
    assert store_log[-1] == ("seal", "default", chunks)
    copy_in, scatter = ("copy", load, "host", "scratch.load", True), kernel(load, "scratch.load", "kv")
    assert load_log[1:-4] == [copy_in, copy_in, copy_in, scatter, copy_in, scatter]


def _watched_round_trip(layout: Any, request: Any, engine: Any, runtime: Any) -> tuple[list, list, Any]:
    """Store, wipe, load under the recorder: the device steps of the store, of the load, and the verdict."""
    stored = roundtrip.snapshot(layout, request)
    with runtime.watching(tagger(layout, engine)):
        runtime.log.clear()
        engine.store(request.tokens, request.store_ids)
        store_log = device_steps(runtime.log)
        roundtrip.zero_planes(layout)
        runtime.log.clear()
        hit = engine.retrieve(request.tokens, request.load_ids)
        load_log = device_steps(runtime.log)
    return store_log, load_log, roundtrip.verify(layout, request, stored, hit)


def test_layerwise_compute_waits_for_each_step_of_the_load(accelerator) -> None:
    """Layerwise: every step stores after the compute stream's writes and is synchronized before LMCache
    takes its MemoryObjs; every loaded step gets its own event, which the compute stream waits for before
    the next step's rows are queued (the forward of layer k needs only steps <= k)."""
    _, runtime = accelerator
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=11)
    request = roundtrip.make_request(layout, 128, seed=2)
    steps, chunks = 3, 2
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, 128))
    with LayoutEngine(layout, storage, kernel_backend="torch", layerwise=True, layer_steps=steps) as engine:
        store, load = engine.connector.store_stream.name, engine.connector.load_stream.name
        store_log, load_log, verdict = _watched_round_trip(layout, request, engine, runtime)
    assert verdict.bit_exact, verdict.problems
    assert store_log == expected_store(store, chunks) * steps
    events = [entry[1] for entry in load_log if entry[0] == "record"]
    assert len(set(events)) == steps
    per_step = [expected_load(load, chunks, event)[:-1] for event in events]
    assert load_log == [entry for step in per_step for entry in step] + [("stream_synchronize", load)]


def test_cpu_has_no_streams_and_no_scratch() -> None:
    """The same engine on CPU memory: transfers are synchronous and go straight into the MemoryObjs."""
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=11)
    with LayoutEngine(layout, StorageOptions(max_local_cpu_size=cache_size_gib(layout, 64))) as engine:
        assert engine.connector.binding.streams.platform is cpu_platform.PLATFORM
        assert (engine.connector.store_stream, engine.connector.load_stream) == (None, None)
        assert engine.connector.binding.scratch == {}



def test_vllm_layerwise_mode_waits_for_each_layer_of_the_forward_and_marks_each_loaded_layer(accelerator) -> None:
    """The paged connector with a ``LayerGate`` (our vLLM integration's layerwise mode): the store stream waits
    for each layer's forward event before that layer's rows of every chunk are gathered and copied out; a load
    queues each layer's copies and kernels, then records that layer's event, which the forward's stream waits
    for."""
    _, runtime = accelerator
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=11)
    request = roundtrip.make_request(layout, 128, seed=2)
    chunks, layers = 2, layout.model_layers
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, 128))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        streams = engine.connector.binding.streams
        store, load = streams.store_stream.name, streams.load_stream.name
        assert all(len(launches) == 1 for _, launches in engine.connector.binding.layer_launches(
            engine.connector.fmt))  # one transfer group per layer here: one piece, one copy per layer and chunk
        stored = roundtrip.snapshot(layout, request)
        with runtime.watching(tagger(layout, engine)):
            written = LayerGate(layers)
            for name in reversed(layers):  # the forward's order does not matter: each layer waits for its own
                written.mark(name, streams.forward_event())
            forward = {entry[2] for entry in runtime.log if entry[0] == "record"}
            runtime.log.clear()
            engine.store(request.tokens, request.store_ids, gate=written)
            store_log = device_steps(runtime.log)
            roundtrip.zero_planes(layout)
            runtime.log.clear()
            loaded = LayerGate(layers)
            hit = engine.retrieve(request.tokens, request.load_ids, gate=loaded)
            load_log = device_steps(runtime.log)
            runtime.log.clear()
            for name in layers:
                ready, event = loaded.wait(name)
                assert ready
                streams.compute_after(event)
            forward_log = list(runtime.log)
    assert roundtrip.verify(layout, request, stored, hit).bit_exact
    assert forward == {"default"}
    waits = [entry[2] for entry in store_log if entry[0] == "wait_event"]
    per_layer = [("wait_event", store, event) for event in waits]
    gathered = [kernel(store, "kv", "scratch.store"), *[("copy", store, "scratch.store", "host", True)] * chunks]
    assert store_log == [("wait_stream", store, "default"), ("enter", store),
                         *[entry for wait in per_layer for entry in (wait, *gathered)],
                         ("exit", store), ("stream_synchronize", store),
                         ("seal", "default", chunks)]
    assert len(set(waits)) == len(layers)
    records = [entry[1] for entry in load_log if entry[0] == "record"]
    queued = [*[("copy", load, "host", "scratch.load", True)] * chunks, kernel(load, "scratch.load", "kv")]
    assert load_log == [("enter", load), *[entry for event in records[:-1] for entry in (*queued, ("record", event,
                        load))], ("exit", load), ("record", records[-1], load), ("wait_event", "default",
                        records[-1]), ("stream_synchronize", load)]
    assert forward_log == [("wait_event", "default", event) for event in records[:-1]]


@pytest.fixture
def xpu_with_triton(monkeypatch) -> Iterator[FakeDeviceRuntime]:
    """The fake XPU, with Triton's interpreter on: the connector hashes what it stages with the GPU kernel."""
    pytest.importorskip("triton")
    from lmcache_platforms.kernels import triton_crc32c

    runtime = FakeDeviceRuntime(1, "fake accelerator")
    platform = xpu_platform.XpuPlatform()
    platform._module = lambda: runtime  # type: ignore[method-assign]
    monkeypatch.setattr(binding_module, "platform_for", lambda device: platform)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_crc32c._kernel.cache_clear()
    yield runtime
    triton_crc32c._kernel.cache_clear()


def hashed_in(load: str, side: str, objects: int = 1) -> list[Entry]:
    """A run of objects crossing into the load scratch, then hashed there on the side stream once the load
    stream's copies so far are done, while the next objects cross (Triton's interpreter then copies the argument
    it read back into place, a blocking copy of the scratch onto itself, a step a GPU does not have)."""
    return [*[("copy", load, "host", "scratch.load", True)] * objects, ("wait_stream", side, load),
            ("enter", side), ("kernel", side, frozenset({"scratch.load"}), frozenset()),
            ("copy", side, "scratch.load", "scratch.load", False), ("exit", side)]


def staged_engine(layout: KVLayout, backend: str) -> LayoutEngine:
    return LayoutEngine(layout, StorageOptions(max_local_cpu_size=cache_size_gib(layout, 128)),
                        kernel_backend=backend)


@pytest.mark.parametrize("run_bytes", [binding_module.HASH_RUN_BYTES, 1])
def test_staged_chunks_are_hashed_on_the_device_and_a_load_checks_before_writing(xpu_with_triton, monkeypatch,
                                                                                run_bytes: int) -> None:
    """Store: the stripe CRCs are made on a side stream once the kernels filled the scratch, beside the copies to
    the host objects (which read the scratch too); the store stream waits for them before it is done, and the
    host seals with them as it would hash. Load: each run of objects is hashed on the side stream once it
    crossed, the host waits for the side stream (the CRCs read back) BEFORE the kernels write the KV cache; a
    flipped byte is refused there, nothing written. Runs of at least ``HASH_RUN_BYTES``: both small objects in
    one, or (runs of a byte) each object on its own once it crossed, while the next one crosses."""
    runtime = xpu_with_triton
    monkeypatch.setattr(binding_module, "HASH_RUN_BYTES", run_bytes)
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=11)
    request = roundtrip.make_request(layout, 128, seed=2)
    with staged_engine(layout, "torch") as engine:
        binding = engine.connector.binding
        assert binding.integrity.on_device
        store, load = engine.connector.store_stream.name, engine.connector.load_stream.name
        store_side = binding.streams.side(engine.connector.store_stream).name
        load_side = binding.streams.side(engine.connector.load_stream).name
        assert len({store, load, store_side, load_side}) == 4
        with pytest.raises(ValueError, match=r"FakeStream\(default\) is neither this binding's store stream nor its "
                                             "load stream"):
            binding.streams.side(runtime.default_stream)
        store_log, load_log, verdict = _watched_round_trip(layout, request, engine, runtime)
        assert verdict.bit_exact, verdict.problems
        hot = engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache
        fmt = engine.connector.fmt
        objects = [obj.tensor.reshape(-1).view(torch.uint8) for obj in hot.values()]
        assert len(objects) == 2
        assert checksum.mismatched(objects, fmt.payload_bytes) == [], "sealed as the host hashes them"
        objects[1][fmt.payload_bytes // 3] ^= 0x5A
        roundtrip.zero_planes(layout)
        runtime.log.clear()
        with runtime.watching(tagger(layout, engine)):
            assert engine.retrieve(request.tokens, request.load_ids) == 0
            refused = device_steps(runtime.log)
        assert not any(p.storage.any() for p in roundtrip.all_planes(layout))
        assert binding.counters.objects_corrupt == 1
    copy_out = ("copy", store, "scratch.store", "host", True)
    hashed_out = [("wait_stream", store_side, store), ("enter", store_side),
                  ("kernel", store_side, frozenset({"scratch.store"}), frozenset()),
                  ("copy", store_side, "scratch.store", "scratch.store", False), ("exit", store_side)]
    assert store_log == [("wait_stream", store, "default"), ("enter", store), kernel(store, "kv", "scratch.store"),
                         *hashed_out, copy_out, copy_out, ("wait_stream", store, store_side), ("exit", store),
                         ("stream_synchronize", store), ("seal", "default", 2)]
    runs = hashed_in(load, load_side, 2) if run_bytes > 1 else hashed_in(load, load_side) * 2
    checked = [("enter", load), *runs, ("stream_synchronize", load_side)]
    assert load_log[: len(checked) + 1] == [*checked, kernel(load, "scratch.load", "kv")]
    assert refused == [*checked, ("exit", load)]


def test_each_scratch_full_is_checked_before_its_own_writes(xpu_with_triton, monkeypatch) -> None:
    """A chunk per scratch-full and the second chunk's object corrupt: the first is checked then written, the
    second checked and refused with nothing of it written (vLLM recomputes the failed load, the first included)."""
    runtime = xpu_with_triton
    monkeypatch.setattr(binding_module, "BATCH_SCRATCH_BYTES", 1)
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=11)
    request = roundtrip.make_request(layout, 128, seed=2)
    with staged_engine(layout, "torch") as engine:
        load = engine.connector.load_stream.name
        load_side = engine.connector.binding.streams.side(engine.connector.load_stream).name
        _store_and_corrupt_second(engine, request)
        roundtrip.zero_planes(layout)
        with runtime.watching(tagger(layout, engine)):
            runtime.log.clear()
            assert engine.retrieve(request.tokens, request.load_ids) == 0
            refused = device_steps(runtime.log)
        assert any(p.storage.any() for p in roundtrip.all_planes(layout)), "the verified first chunk was written"
        assert engine.connector.binding.counters.objects_corrupt == 1
    checked = [*hashed_in(load, load_side), ("stream_synchronize", load_side)]
    assert refused == [("enter", load), *checked, kernel(load, "scratch.load", "kv"), *checked, ("exit", load)]


def _store_and_corrupt_second(engine: LayoutEngine, request: roundtrip.Request) -> None:
    """Store the request's two chunks, then flip one payload byte of the second's object in the CPU cache."""
    engine.store(request.tokens, request.store_ids)
    keys = [key for _, _, key in engine.engine.token_database.process_tokens(
        tokens=torch.tensor(request.tokens), request_configs=engine.tags)]
    hot = engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache
    assert len(keys) == 2
    hot[keys[1]].tensor.reshape(-1).view(torch.uint8)[engine.connector.fmt.payload_bytes // 3] ^= 0x5A


@pytest.mark.parametrize("fault", ["wrong values", "kernel error"])
def test_a_device_whose_hashes_disagree_leaves_them_to_the_host(xpu_with_triton, monkeypatch, caplog, fault) -> None:
    """The binding builds and runs the kernel once on the device against the native CRC-32C: if it fails there or
    computes other values, one warning says so and the host hashes every chunk."""
    import logging

    from lmcache_platforms.kernels import triton_crc32c

    real = triton_crc32c.stripe_crcs

    def planted(*args: Any) -> torch.Tensor:
        if fault == "kernel error":
            raise RuntimeError("no kernel image for this device")
        return real(*args) ^ 1

    monkeypatch.setattr(triton_crc32c, "stripe_crcs", planted)
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=11)
    logger = logging.getLogger("lmcache_platforms")
    logger.addHandler(caplog.handler)
    try:
        binding = binding_module.LayoutBinding(layout, [paged_format(layout)], "torch")
    finally:
        logger.removeHandler(caplog.handler)
    assert not binding.integrity.on_device
    why = ("RuntimeError: no kernel image for this device" if fault == "kernel error" else
           "the native CRC-32C gives")
    (warning,) = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warning.startswith("chunk checksums are computed on the host, not on cpu: ") and why in warning
