"""Transfer speed of a layout's whole chunks (store and load) against a plain copy of the same bytes.

Every transfer group of every whole chunk is moved with real slot lists (random distinct non-null blocks), into
and out of one object per chunk laid out as the connector lays out LMCache's MemoryObjs. Store, load, the same
store and load with the objects' checksum (hashed by the store's and the load's kernels as they copy, as the
connector does on CPU memory objects), and plain copies of the same byte count
(`Tensor.copy_`, and on CPU a contiguous copy through the native library's thread pool; same thread count, the
faster one is the memcpy reference) are timed in interleaved rounds after a warm-up, best of --repeats each;
where upstream LMCache 0.5.6's own torch path can move the layout, it is timed the same way against its own
copies. On CPU the checked load is also timed where the layout adds nothing (contiguous whole-stripe rows), its
floor. On an accelerator the connector's own path to LMCache's pinned host objects (``LayoutBinding``) is timed
against a pinned copy, also with the objects' checksum made on the device and on the host, and on CUDA the GPU
time alone (CUDA graph replay) against a device copy replayed the same way.

The results print as a table (figures that do not apply on this machine left out); ``--json`` prints them as
one JSON object, the last line, for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmcache_platforms.layout.plane import Plane

from lmcache_platforms.cli.bench_output import engine_table, layout_table, servers_table
from lmcache_platforms.tools.copy_reference import best_copy, best_of_rounds, copiers, graph_seconds

GIB = 1e9


# The options each of the three benchmarks reads (``--json`` is everyone's): one given to another is refused,
# not ignored (``--engine --layout gemma3`` wrote 681 MB of weights for an engine bench nobody asked for).
BENCH_OPTIONS = {
    "--layout": ("layout", "backend", "chunks", "mode", "device", "repeats", "seed"),
    "--engine": ("engine", "model", "full_attention_every", "tokens", "requests", "chunk_size", "tiers", "modes",
                 "kv_events", "checksum_cost", "idle_steps", "workdir"),
    "--servers": ("servers", "model", "tokens", "chunk_size", "groups", "rounds", "concurrency", "workdir"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", help="layout file, or the name of a shipped example")
    engine = parser.add_argument_group("inside a real engine (--engine, instead of --layout)")
    engine.add_argument("--engine", action="store_true",
                        help="store and load N-token prompts through in-process vLLM engines with our connector, "
                             "per LMCache storage tier, against a copy of the same bytes in the same process")
    engine.add_argument("--model", choices=("demo", "tiny"), default="demo", help="the random model (default demo)")
    engine.add_argument("--full-attention-every", type=int, default=None,
                        help="every Nth layer attends fully, the others slide (default: the model's; vLLM makes "
                             "one KV-cache group per layer type and share, so this sets the number of groups)")
    engine.add_argument("--tokens", type=int, default=2048, help="tokens per prompt (default 2048)")
    engine.add_argument("--requests", type=int, default=3, help="prompts per tier (default 3)")
    engine.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size (default 256)")
    engine.add_argument("--tiers", default="cpu,disk,fs,redis",
                        help="comma list of cpu, disk, fs, redis, redis-cluster, and vllm: no connector, vLLM's "
                             "own prefix cache, each prompt twice (adds warm_ttft_x_vllm_hit to every tier's row)")
    engine.add_argument("--modes", default="paged",
                        help="comma list of paged, layerwise (LMCache's use_layerwise); both adds load_hidden")
    engine.add_argument("--kv-events", action="store_true",
                        help="every engine publishes KV-cache events through vLLM's ZMQ publisher, as a server "
                             "with --kv-events-config does (our connector's BlockStored/BlockRemoved included)")
    engine.add_argument("--checksum-cost", action="store_true",
                        help="pair every hashing store and checking load with the plain kernel call of the same "
                             "arguments and time the checksum's own calls: adds checksum_{store,load}_ms, "
                             "_python_ms and _share (the row's other timings then include the paired calls)")
    engine.add_argument("--idle-steps", type=int, default=0, metavar="N",
                        help="after each tier's cold pass, decode N tokens of a prompt shorter than a chunk (nothing "
                             "to store or load) with every connector method timed: adds idle_connector_ms_per_step, "
                             "idle_step_ms, idle_connector_share and the ms per step of each method")
    engine.add_argument("--workdir", type=Path, default=None,
                        help="where configs and logs go (default: a temporary folder, kept if a tier failed)")
    scale = parser.add_argument_group("across servers (--servers, instead of --layout; --model, --tokens and "
                                      "--chunk-size as for --engine)")
    scale.add_argument("--servers", default=None,
                       help="comma list of server counts, e.g. 1,2,3: that many `vllm serve` with our connector "
                            "on one local Redis Cluster, a shared-prefix workload of --tokens-token prefixes")
    scale.add_argument("--groups", type=int, default=6, help="prefixes of the --servers workload (default 6)")
    scale.add_argument("--rounds", type=int, default=3,
                       help="rounds of the --servers workload, each prefix once per round (default 3)")
    scale.add_argument("--concurrency", type=int, default=1,
                       help="requests each server has in flight at once in the --servers workload (default 1)")
    parser.add_argument("--backend", default=None,
                        help="auto, torch, cpu, triton, ascend (default: platforms.kernel_backend setting)")
    parser.add_argument("--chunks", type=int, default=None, help="move at most N whole chunks (default: all)")
    parser.add_argument("--mode", choices=("bundled", "exploded"), default="bundled")
    parser.add_argument("--device", default="cpu", help="torch device holding the KV cache (default cpu)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed rounds; the best of each counts (upstream, being slow, gets a quarter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object as the last line instead of the table (what scripts read)")
    dests = {dest for dests in BENCH_OPTIONS.values() for dest in dests}
    parser.set_defaults(bench_defaults={dest: parser.get_default(dest) for dest in sorted(dests)})


def _fail(message: str) -> int:
    print(f"lmcache-platforms bench: {message}", file=sys.stderr)
    return 2


@dataclass
class Batch:
    """One transfer group of a run of chunks, moved by one call (``transfer_chunks``) as the connector's binding
    moves them: its planes, the chunks' slots ``[count, rows]``, the buffer from the group's bytes of the run's
    first chunk on, and the bytes from one chunk's object to the next."""

    planes: tuple[Plane, ...]
    slots: torch.Tensor
    buffer: torch.Tensor
    stride: int
    first: int  # the run's first chunk
    offset: int  # the group's bytes' offset in each chunk's object


def _synchronizer(device) -> Callable[[], None]:
    import torch

    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None) if device.type != "cpu" else None
    return sync if callable(sync) else (lambda: None)


def _block_ids(spec):
    """Random distinct non-null block ids per group, enough for the layout's num_tokens."""
    import torch

    from lmcache_platforms.layout.slots import rows_for_tokens

    ids = []
    for group, blocks in zip(spec.groups, spec.num_blocks, strict=True):
        need = -(-rows_for_tokens(spec.num_tokens, group) // group.block_size)
        if need > blocks - 1:
            raise ValueError(f"group {group.index} needs {need} blocks for {spec.num_tokens} tokens, "
                             f"the layout has {blocks} (block 0 is the null block)")
        ids.append(torch.randperm(blocks - 1)[:need] + 1)
    return ids


def _batches(layout, block_ids, chunks: int, device) -> tuple[list[torch.Tensor], list[Batch], int]:
    """One object per chunk (the connector's chunk format, side by side in one allocation), the calls that
    move them (per run of chunks as many as the connector's staging scratch holds, one per transfer group),
    and the launches per chunk."""
    import torch

    from lmcache_platforms.connector.binding import batch_runs
    from lmcache_platforms.connector.chunk_format import paged_format

    fmt = paged_format(layout)
    pinned = device.type != "cpu"  # slots as the connector passes them (``LayoutBinding.chunk_slots``)
    whole = torch.zeros(chunks * fmt.nbytes, dtype=torch.uint8, device=device)
    objects = [whole[c * fmt.nbytes : (c + 1) * fmt.nbytes] for c in range(chunks)]
    batches = []
    for first, count in batch_runs(chunks, fmt.payload_bytes):
        bounds = [(c * layout.chunk_size, (c + 1) * layout.chunk_size) for c in range(first, first + count)]
        for launch in fmt.launches:
            slots = _pinned_if(layout.group_chunks_slots(launch.tg.group, block_ids, bounds), pinned)
            batches.append(Batch(launch.planes, slots, whole[first * fmt.nbytes + launch.offset :], fmt.nbytes,
                                 first, launch.offset))
    return objects, batches, len(fmt.launches)


def _pinned_if(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    return tensor.pin_memory() if pinned else tensor


def _upstream_path(spec, block_ids, chunks: int, device, seed: int):
    """(format name, bytes, store work, load work) of upstream LMCache's torch path for this layout, or None
    (another layout, or LMCache not installed).

    Upstream 0.5.6 ``mem_kernels.multi_layer_kv_transfer`` (its in-process path) takes one group of identical
    single-tensor layers, either flash ``(nb, 2, bs, ...)`` or MLA ``(nb, bs, ...)`` without block padding.
    """
    import torch

    from lmcache_platforms.layout.slots import chunk_slots
    from lmcache_platforms.tools.fixtures import materialize_tensors

    groups = spec.groups
    if len(groups) != 1 or groups[0].tokens_per_row != 1 or groups[0].kind.reach(groups[0]) is not None:
        return None
    shapes = {(p.shape, p.dims) for layer in spec.layers for p in layer.planes}
    if len(shapes) != 1 or spec.block_padding_bytes or any(len(layer.planes) != 1 for layer in spec.layers):
        return None
    shape, dims = shapes.pop()
    try:
        from lmcache.lmcache_native import EngineKVFormat, TransferDirection
        from lmcache.v1.platform.torch_ops.mem_kernels import multi_layer_kv_transfer
    except ImportError:  # the kernels alone, on a machine without LMCache (a GPU box running device-check)
        return None

    nb, bs, layers = shape[0], groups[0].block_size, len(spec.layers)
    split: tuple[int, ...]
    if dims[:3] == ("nb", "kv", "bs"):
        fmt, split, kv_dims = EngineKVFormat.NL_X_NB_TWO_BS_NH_HS, (nb, 2, bs, -1), 2
    elif dims[:2] == ("nb", "bs") and "kv" not in dims:
        fmt, split, kv_dims = EngineKVFormat.NL_X_NB_BS_HS, (nb * bs, -1), 1
    else:
        return None
    paged = [t[0].reshape(split) for t in materialize_tensors(spec, device, seed).values()]
    work = []
    for c in range(chunks):
        start, end = c * spec.chunk_size, (c + 1) * spec.chunk_size
        slots = chunk_slots(groups[0], block_ids[0], start, end, spec.chunk_size).to(device)
        kv = torch.empty((kv_dims, layers, spec.chunk_size, paged[0].shape[-1]), dtype=paged[0].dtype,
                         device=device)
        work.append((slots, kv))

    def run(direction) -> Callable[[], None]:
        def move() -> None:
            for slots, kv in work:
                multi_layer_kv_transfer(kv, paged, slots, device, nb * bs, direction, fmt, block_size=bs)

        return move

    moved = sum(kv.numel() * kv.element_size() for _, kv in work)
    return fmt.name, moved, run(TransferDirection.D2H), run(TransferDirection.H2D)


def _time_backend(spec, args, block_ids, chunks: int, device, sync) -> dict:
    """Best store, load and same-size copy seconds over every whole chunk, and the launches per chunk."""
    from lmcache_platforms.config import PlatformSettings
    from lmcache_platforms.kernels.contract import Direction
    from lmcache_platforms.kernels.registry import select_backend
    from lmcache_platforms.layout.plane import buffer_bytes
    from lmcache_platforms.tools.fixtures import materialize

    settings = PlatformSettings.load()
    layout = materialize(spec, args.mode, device=device, seed=args.seed, rows=settings.chunk_rows)
    preference = args.backend or settings.kernel_backend
    backend = select_backend([p for tg in layout.transfer_groups for p in tg.planes], device, preference)
    objects, batches, launches = _batches(layout, block_ids, chunks, device)
    moved = sum(batch.slots.shape[0] * buffer_bytes(batch.planes, batch.slots.shape[-1]) for batch in batches)

    def run(direction: Direction) -> Callable[[], None]:
        def move() -> None:
            for batch in batches:
                backend.transfer_chunks(batch.planes, batch.slots, batch.buffer, batch.stride, direction)

        return move

    copies = copiers(moved, device)
    store, load = run(Direction.STORE), run(Direction.LOAD)
    works: dict[str, Callable[[], object]] = {"store": store, "load": load}
    if device.type == "cpu":  # LMCache's objects are host memory: the checksum runs on the CPU
        works.update(_checksummed(objects, batches, backend, load, moved))
        works.update(_checked_floor(len(objects), moved // len(objects), backend))
    else:
        works.update(_through_binding(layout, block_ids, chunks, preference, moved, device))
    works.update({name: work for name, (work, _) in copies.items()})
    best = best_of_rounds(works, sync, args.repeats)
    best.update(best_copy(best, copies))
    if device.type == "cuda":
        gpu = graph_seconds({"store": store, "load": load, "copy": copies["copy_"][0]}, args.repeats)
        best.update({f"gpu_{name}": s for name, s in gpu.items()})
    return {"backend": backend.name, "bytes": moved, "launches_per_chunk": launches, **best}


def _through_binding(layout, block_ids, chunks: int, backend: str, moved: int,
                     device) -> dict[str, Callable[[], object]]:
    """On an accelerator, the connector's own path to LMCache's pinned host objects (``LayoutBinding``: the
    kernels into its device scratch a scratch-full at a time, then one copy per chunk across the bus, on its
    transfer streams), and the reference that path is judged against: a plain pinned copy of the same bytes each
    way. Then the same with each object's checksum, both ways the binding makes it: stripe CRCs from the device
    (``kernels.triton_crc32c``, where the binding found the kernel agreeing with the host) and from a pass over
    the host objects (a store after its copies, a load before them, as where the device cannot hash)."""
    import torch

    from lmcache_platforms.connector.binding import LayoutBinding
    from lmcache_platforms.connector.chunk_format import paged_format

    fmt = paged_format(layout)
    binding = LayoutBinding(layout, [fmt], backend)
    device_hashes = binding.integrity.on_device
    hosts = [torch.zeros(fmt.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(chunks)]
    starts = [c * layout.chunk_size for c in range(chunks)]
    slots = binding.chunk_slots(fmt, block_ids, starts, [start + layout.chunk_size for start in starts])

    def store(on_device: bool, sealed: bool) -> Callable[[], None]:
        def move() -> None:
            binding.integrity.on_device = on_device
            stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=True) if sealed else None
            with binding.streams.storing():
                binding.store_chunks(fmt, hosts, slots, stripes=stripes)
            binding.streams.finish_store()
            if stripes is not None:
                stripes.seal(hosts)

        return move

    def load(on_device: bool, checked: bool) -> Callable[[], None]:
        def move() -> None:
            binding.integrity.on_device = on_device
            if checked and (corrupt := binding.load_verified(fmt, hosts, slots)):
                raise RuntimeError(f"bench: sealed objects {corrupt} failed their checksum")
            if not checked:
                with binding.streams.loading():
                    binding.load_chunks(fmt, hosts, slots, fmt.launches)
            binding.streams.finish_load()

        return move

    pinned = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(moved, dtype=torch.uint8, device=device)
    works: dict[str, Callable[[], object]] = {
        "store_to_host": store(False, False), "load_from_host": load(False, False),
        "pinned_d2h": lambda: pinned.copy_(on_device, non_blocking=True),
        "pinned_h2d": lambda: on_device.copy_(pinned, non_blocking=True),
        "store_to_host_host_checksum": store(False, True), "load_from_host_host_checksum": load(False, True)}
    store(device_hashes, True)()  # sealed before the first load checks them
    if device_hashes:
        works.update({"store_to_host_device_checksum": store(True, True),
                      "load_from_host_device_checksum": load(True, True)})
    return works


def _checksummed(objects: list[torch.Tensor], batches: list[Batch], backend, load: Callable[[], None],
                 payload: int) -> dict[str, Callable[[], None]]:
    """Store then seal the batch's objects, check them then load, and the checksum alone (CPU objects), as the
    connector does per batch of chunks: the store object by object, each group's kernel hashing the bytes it
    copies (``KernelBackend.store_hashed``), the load too (``KernelBackend.load_hashed``), its verdict after
    the copy; and the plain store and load object by object, the same way."""
    from lmcache_platforms.connector import checksum
    from lmcache_platforms.kernels.contract import Direction
    from lmcache_platforms.layout.plane import buffer_bytes

    per_object = payload // len(objects)
    # Each object's groups in byte order, as the connector moves them: offset, batch, row, bytes.
    parts: list[list[tuple[int, Batch, int, int]]] = [[] for _ in objects]
    for batch in batches:
        for index in range(batch.slots.shape[0]):
            parts[batch.first + index].append((batch.offset, batch, index,
                                               buffer_bytes(batch.planes, batch.slots.shape[-1])))
    for object_parts in parts:
        object_parts.sort(key=lambda part: part[0])
    stripes = checksum.stripe_room(per_object, len(objects))

    def store_checksummed() -> None:
        for index, obj in enumerate(objects):
            if stripes is None:  # no native CRC-32C: store, then hash
                for offset, batch, row, nbytes in parts[index]:
                    backend.transfer(batch.planes, batch.slots[row], obj[offset : offset + nbytes], Direction.STORE)
                continue
            hashed = checksum.object_stripes(per_object)[0]
            for offset, batch, row, nbytes in parts[index]:
                backend.store_hashed(batch.planes, batch.slots[row], obj[offset : offset + nbytes], hashed, offset)
            hashed.finish(stripes[index])
        checksum.seal(objects, per_object, stripes)

    def load_checksummed() -> None:
        if stripes is None:  # no native CRC-32C: check every object, then load
            if checksum.mismatched(objects, per_object):
                raise RuntimeError("bench: a sealed object failed its checksum")
            load()
            return
        for index, obj in enumerate(objects):
            _load_verified(backend, obj, per_object, ((batch.planes, batch.slots[row], offset, nbytes)
                                                      for offset, batch, row, nbytes in parts[index]))

    def crc() -> None:
        checksum.checksums(objects, per_object)

    def one_by_one(direction: Direction) -> Callable[[], None]:
        """The plain store or load object by object, part by part: the connector's own path into host objects
        where it does not hash, so the checksummed rounds' cost against it is the user's."""
        def move() -> None:
            for index, obj in enumerate(objects):
                for offset, batch, row, nbytes in parts[index]:
                    backend.transfer(batch.planes, batch.slots[row], obj[offset : offset + nbytes], direction)

        return move

    return {"store_checksummed": store_checksummed, "load_checksummed": load_checksummed, "checksum": crc,
            "store_per_object": one_by_one(Direction.STORE), "load_per_object": one_by_one(Direction.LOAD)}


def _load_verified(backend, obj: torch.Tensor, payload: int,
                   launches: Iterable[tuple[Sequence[Plane], torch.Tensor, int, int]]) -> None:
    """One sealed host object loaded as the connector loads one: each launch (planes, slots, object offset,
    bytes) hashing the bytes it copies, then the object's stripes compared with those it carries; raises when
    they differ (bench seals its own objects, so none should)."""
    import torch

    from lmcache_platforms.connector import checksum

    (carried,) = checksum.carried_stripes([obj], payload)
    hashed = checksum.object_stripes(payload)[0]
    for planes, rows, offset, nbytes in launches:
        backend.load_hashed(planes, rows, obj[offset : offset + nbytes], hashed, offset)
    got = torch.empty(hashed.count, dtype=torch.int32)
    hashed.finish(got)
    if carried is None or not torch.equal(carried, got):
        raise RuntimeError("bench: a sealed object failed its checksum")


FLOOR_ROW_BYTES = 64 << 10


def _checked_floor(count: int, per_object: int, backend) -> dict[str, Callable[[], None]]:
    """The same number of objects of about the same size, each loaded into contiguous 64 KiB rows, plain and
    checked: what hashing each byte as it is copied costs where the layout adds nothing (rows that are
    whole stripes, one run), so a layout's ``checksum_load_cost_per_object`` reads against this floor. Nothing
    without the native CRC-32C, where a load checks each object whole before writing any of it."""
    import torch

    from lmcache_platforms.connector import checksum
    from lmcache_platforms.kernels.contract import Direction
    from lmcache_platforms.layout.plane import Plane, PlaneGeometry

    if not checksum.stripes_are_crc32c():  # without the native CRC-32C a load checks every object first
        return {}
    rows = max(1, -(-per_object // FLOOR_ROW_BYTES))
    payload = rows * FLOOR_ROW_BYTES
    size = payload + checksum.tail_bytes(payload)
    whole = torch.randint(0, 256, (count * size,), dtype=torch.uint8)
    objects = [whole[index * size : (index + 1) * size] for index in range(count)]
    checksum.seal(objects, payload)
    target = torch.empty(count * payload, dtype=torch.uint8)
    plane = Plane("floor", "target", 0, torch.uint8,
                  PlaneGeometry(count * rows, FLOOR_ROW_BYTES, 1, FLOOR_ROW_BYTES, 1, FLOOR_ROW_BYTES,
                                FLOOR_ROW_BYTES), 0, target)
    slots = [torch.arange(index * rows, (index + 1) * rows) for index in range(count)]

    def plain() -> None:
        for obj, rows_of in zip(objects, slots, strict=True):
            backend.transfer((plane,), rows_of, obj[:payload], Direction.LOAD)

    def checked() -> None:
        for obj, rows_of in zip(objects, slots, strict=True):
            _load_verified(backend, obj, payload, [((plane,), rows_of, 0, payload)])

    return {"floor_load": plain, "floor_checked": checked}


def _time_upstream(spec, block_ids, chunks: int, device, sync, args) -> dict | None:
    """Upstream's store and load speed as multiples of a same-size copy timed in the same rounds."""
    path = _upstream_path(spec, block_ids, chunks, device, args.seed)
    if path is None:
        return None
    name, moved, store, load = path
    copies = copiers(moved, device)
    works = {"store": store, "load": load, **{name: work for name, (work, _) in copies.items()}}
    best = best_of_rounds(works, sync, max(1, args.repeats // 4))
    best.update(best_copy(best, copies))
    return {"format": name, "store_x": best["copy"] / best["store"], "load_x": best["copy"] / best["load"]}


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args``; raises ValueError (LayoutError) or BackendUnavailable."""
    import torch

    from lmcache_platforms.layout.files import load_layout_spec

    spec = load_layout_spec(args.layout)
    device = torch.device(args.device)
    sync = _synchronizer(device)
    torch.manual_seed(args.seed)
    total_chunks = spec.num_tokens // spec.chunk_size
    chunks = total_chunks if args.chunks is None else min(args.chunks, total_chunks)
    if chunks < 1:
        raise ValueError(f"the layout has {spec.num_tokens} tokens, no whole chunk of {spec.chunk_size}")
    block_ids = _block_ids(spec)
    ours = _time_backend(spec, args, block_ids, chunks, device, sync)
    upstream = _time_upstream(spec, block_ids, chunks, device, sync, args)
    moved = ours["bytes"]
    result = {
        "layout": spec.name,
        "mode": args.mode,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "chunks": chunks,
        "bytes": moved,
        "backend": ours["backend"],
        "store_GBps": moved / ours["store"] / GIB,
        "load_GBps": moved / ours["load"] / GIB,
        "memcpy_GBps": moved / ours["copy"] / GIB,
        "torch_copy_GBps": moved / ours["copy_"] / GIB,
        "pool_copy_GBps": moved / ours["pool"] / GIB if "pool" in ours else None,
        "store_x_memcpy": ours["copy"] / ours["store"],
        "load_x_memcpy": ours["copy"] / ours["load"],
        "upstream_format": upstream["format"] if upstream else None,
        "upstream_store_x_memcpy": upstream["store_x"] if upstream else None,
        "upstream_load_x_memcpy": upstream["load_x"] if upstream else None,
        "launches_per_chunk": ours["launches_per_chunk"],
        # The same store and load with each object's checksum (None off CPU), and the checksum alone.
        "store_checksummed_x_memcpy": ours["copy"] / ours["store_checksummed"] if "checksum" in ours else None,
        "load_checksummed_x_memcpy": ours["copy"] / ours["load_checksummed"] if "checksum" in ours else None,
        "checksum_store_cost": ours["store_checksummed"] / ours["store"] - 1 if "checksum" in ours else None,
        "checksum_load_cost": ours["load_checksummed"] / ours["load"] - 1 if "checksum" in ours else None,
        # The same against the plain store and load object by object, as the connector moves host objects.
        "checksum_store_cost_per_object":
            ours["store_checksummed"] / ours["store_per_object"] - 1 if "checksum" in ours else None,
        "checksum_load_cost_per_object":
            ours["load_checksummed"] / ours["load_per_object"] - 1 if "checksum" in ours else None,
        "checksum_GBps": moved / ours["checksum"] / GIB if "checksum" in ours else None,
        # The same load cost where the layout adds nothing: the cost of hashing each byte as it is copied.
        "checksum_load_floor": ours["floor_checked"] / ours["floor_load"] - 1 if "floor_load" in ours else None,
        # Off CPU: the whole path to and from LMCache's pinned host objects, against a pinned copy each way.
        **_pinned_figures(ours, moved),
        # Off CPU: the same paths with each object's checksum from the device or from the host, as extra time.
        **_checksum_figures(ours),
        # On CUDA: GPU time alone (graph replay, no host launch cost), against a device copy timed the same way.
        **_gpu_figures(ours),
    }
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def _checksum_figures(ours: dict) -> dict[str, float | None]:
    """Off CPU: what each way of making the checksum adds to the whole path's time (0.1 = 10% longer)."""
    out: dict[str, float | None] = {}
    for way in ("device", "host"):
        for path in ("store_to_host", "load_from_host"):
            seconds = ours.get(f"{path}_{way}_checksum")
            out[f"{path}_{way}_checksum_cost"] = seconds / ours[path] - 1 if seconds is not None else None
    return out


def _pinned_figures(ours: dict, moved: int) -> dict[str, float | None]:
    names = ("pinned_d2h_GBps", "pinned_h2d_GBps", "store_to_host_GBps", "load_from_host_GBps",
             "store_to_host_x_pinned_copy", "load_from_host_x_pinned_copy")
    if "pinned_d2h" not in ours:
        return dict.fromkeys(names, None)
    seconds = (ours["pinned_d2h"], ours["pinned_h2d"], ours["store_to_host"], ours["load_from_host"])
    figures = [moved / s / GIB for s in seconds]
    figures += [ours["pinned_d2h"] / ours["store_to_host"], ours["pinned_h2d"] / ours["load_from_host"]]
    return dict(zip(names, figures, strict=True))


def _gpu_figures(ours: dict) -> dict[str, float | None]:
    names = ("gpu_store_x_device_copy", "gpu_load_x_device_copy")
    if "gpu_copy" not in ours:
        return dict.fromkeys(names, None)
    return dict(zip(names, (ours["gpu_copy"] / ours["gpu_store"], ours["gpu_copy"] / ours["gpu_load"]), strict=True))


def run_engine(args: argparse.Namespace) -> int:
    """``--engine``: one table row (or JSON object) per tier."""
    from lmcache_platforms.cli.workdir import run_in_workdir
    from lmcache_platforms.tools.engine_bench import bench_from_args, run_bench

    if args.tokens < args.chunk_size or args.requests < 1:
        return _fail(f"--engine needs --tokens >= --chunk-size and --requests >= 1, got {args.tokens}, "
                     f"{args.chunk_size}, {args.requests}")

    def body(folder: Path) -> list[str]:
        result = run_bench(bench_from_args(args, folder), lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(result) if args.json else engine_table(result))
        return [f"tier {row['tier']} ({row['mode']}): {row['error']}" for row in result["tiers"] if "error" in row]

    try:
        return run_in_workdir(args.workdir, False, "lmcache-platforms-bench-", print, body)
    except ValueError as exc:
        return _fail(str(exc))


def run_scale_out(args: argparse.Namespace) -> int:
    """``--servers``: one table row (or JSON object) per server count."""
    from lmcache_platforms.cli.workdir import run_in_workdir
    from lmcache_platforms.tools.demo.model import MODELS, ensure_model, with_context
    from lmcache_platforms.tools.scale_bench import ANSWERED_TOKENS, ScaleBench, run_scale

    try:
        counts = tuple(int(n) for n in args.servers.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        return _fail(f"--servers takes a comma list of server counts of 1 or more, got {args.servers!r}")
    if args.tokens < args.chunk_size or args.groups < 1 or args.rounds < 2 or args.concurrency < 1:
        return _fail(f"--servers needs --tokens >= --chunk-size, --groups >= 1, --rounds >= 2 and --concurrency "
                     f">= 1, got {args.tokens}, {args.chunk_size}, {args.groups}, {args.rounds}, {args.concurrency}")
    model = with_context(MODELS[args.model], args.tokens + ANSWERED_TOKENS)

    def body(folder: Path) -> list[str]:
        bench = ScaleBench(model, ensure_model(model), counts, args.tokens, args.groups, args.rounds,
                           args.chunk_size, folder, args.concurrency)
        result = run_scale(bench, lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(result) if args.json else servers_table(result))
        return [f"{row['servers']} server(s): {row['errors']} failed requests" for row in result["rows"]
                if row["errors"]]

    return run_in_workdir(args.workdir, False, "lmcache-platforms-bench-", print, body)


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def misplaced(args: argparse.Namespace, defaults: dict[str, object]) -> str | None:
    """Why these options do not make one benchmark: none or several of --layout, --engine, --servers, or an
    option the chosen one does not read (``defaults``: the parser's, an option left at its default is not
    given)."""
    chosen = [name for name in BENCH_OPTIONS if getattr(args, name[2:]) not in (None, False)]
    if len(chosen) != 1:
        given = f" (got {' and '.join(chosen)})" if chosen else ""
        return f"give one of --layout (a layout file or shipped example), --engine or --servers{given}"
    mine = BENCH_OPTIONS[chosen[0]]
    for dest, default in defaults.items():
        if dest not in mine and dest != "json" and getattr(args, dest) != default:
            owners = [name for name, dests in BENCH_OPTIONS.items() if dest in dests]
            return (f"{_option(dest)} is an option of {' and '.join(owners)}, not of {chosen[0]}: it would be "
                    "ignored")
    return None


def run(args: argparse.Namespace) -> int:
    if problem := misplaced(args, args.bench_defaults):
        return _fail(problem)
    if args.engine:
        return run_engine(args)
    if args.servers is not None:
        return run_scale_out(args)
    if args.repeats < 1:
        return _fail(f"--repeats must be at least 1, got {args.repeats}")
    if args.chunks is not None and args.chunks < 1:
        return _fail(f"--chunks must be at least 1, got {args.chunks}")
    from lmcache_platforms.kernels.registry import BackendUnavailable

    try:
        result = measure(args)
    except (ValueError, BackendUnavailable) as exc:
        return _fail(str(exc))
    print(json.dumps(result) if args.json else layout_table(result))
    return 0
