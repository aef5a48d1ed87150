"""Chunks stored as parts (``layout.parts``): one MemoryObj per part per chunk, under part-qualified keys.

LMCache's engine knows one object per chunk key. A layout with window or snapshot groups beside full attention
stores each chunk as several objects instead, one per part, told apart by the ``lmcache.tag.lmcp_part``
request config (LMCache puts ``lmcache.tag.*`` entries into its keys), so every tier (local CPU, local disk,
remote) holds, evicts and returns them independently. Stores write every part of every chunk
(``connector.chunk_stores``: any chunk may end a later hit); loads read the parts through ``connector.chunk_loads``,
which asks this module where each object is (``where_held``); ``lookup_method`` is one engine instance's
``lookup`` made to find parts (``instance_adapter`` installs it):

- ``lookup`` reports the longest hit for which every part holds every chunk it needs (``longest_hit``),
  so an evicted window part of an early chunk (never read again) costs nothing, and pins exactly those
  objects.

Which objects are held is asked for a run of chunks at once (``_held_run``), never one object at a time: each
question to a remote store is a round trip. A lookup asks first for every object of the whole prompt's hit in
one run. A load asks nothing when the lookup before it pinned every object it reads (vLLM's loads: the hit
looked up), else for every part's in one run, and reads each object from the tier found.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmcache_platforms.layout.parts import ChunkPart, longest_hit, needed_chunks
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

PART_TAG = "lmcache.tag.lmcp_part"
WHOLE = "whole"  # the part name, in the store's and load's log lines, of chunks stored whole


def objects_per_part(parts: Sequence[ChunkPart | None]) -> str:
    """``name: count`` of the objects of each part in ``parts`` (one entry per object; None, ``whole``, for
    chunks stored whole), as the store's and load's log lines say it and ``bench`` reads it."""
    counts: dict[str, int] = {}
    for part in parts:
        name = WHOLE if part is None else part.name
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name}: {count}" for name, count in counts.items())


def part_configs(request_configs: Mapping[str, Any] | None, part: ChunkPart) -> dict[str, Any]:
    """``request_configs`` with the part's key tag."""
    return {**(request_configs or {}), PART_TAG: part.name}


def lookup_method(engine: Any, lookup: Callable[..., Any], parts: Sequence[ChunkPart],
                  chunk_size: int) -> Callable[..., Any]:
    """``engine``'s ``lookup`` made to find every part of every chunk a hit needs (``_lookup``)."""
    return functools.wraps(lookup)(functools.partial(_lookup, engine, tuple(parts), chunk_size))


def where_held(engine: Any, keys: Sequence[Any], request_id: str | None) -> tuple[int, dict[Any, str]]:
    """How many of ``keys``, from the first, are held, and the tier of each: the lookup's pins for
    ``request_id`` if they hold them all, else asked (``_held_run``)."""
    pins = engine.lookup_pins.get(request_id) if request_id is not None else None
    pinned = _tier_of_each(pins or {})
    if pinned and all(key in pinned for key in keys):
        return len(keys), pinned
    held, where = _held_run(engine.storage_manager, keys, None, False)
    return held, _tier_of_each(where)


def _tier_of_each(by_tier: Mapping[str, Sequence[Any]]) -> dict[Any, str]:
    """The tier of each key, from keys listed by tier (``_held_run``'s answer, a lookup's pins)."""
    return {key: tier for tier, keys in by_tier.items() for key in keys}


def _held_run(manager: Any, keys: Sequence[Any], search_range: list[str] | None,
             pin: bool) -> tuple[int, dict[str, list[Any]]]:
    """How many of ``keys``, from the first, some tier holds, and which tier holds each (pinned there with
    ``pin``). Asked as one batch per tier (a remote store answers it in one round trip, where one key at a time
    made one each); a key the batch stopped at is asked on its own, since the tiers may hold a run out of
    their order (an early chunk evicted from the CPU cache but on disk), and the batch resumes after it."""
    held = 0
    where: dict[str, list[Any]] = {}
    while held < len(keys):
        count, mapping = manager.batched_contains(list(keys[held:]), search_range, pin)
        _record(where, mapping)
        held += count
        if held == len(keys):
            break
        location = manager.contains(keys[held], search_range, pin)
        if location is None:
            break
        where.setdefault(location, []).append(keys[held])
        held += 1
    return held, where


def _asked_in_runs(manager: Any, keys: Sequence[Any], search_range: list[str] | None,
                   pinned: dict[str, list[Any]] | None, known: dict[int, bool]) -> Callable[[int], bool]:
    """Whether chunk ``i``'s object is stored, ``known`` or asked. A chunk not yet known is asked together with
    every chunk after it (``_held_run``). With ``pinned``, what is found is pinned as it is asked, and recorded
    there by tier."""

    def present(i: int) -> bool:
        if i not in known:
            count, where = _held_run(manager, keys[i:], search_range, pinned is not None)
            _record(pinned, where)
            known.update(dict.fromkeys(range(i, i + count), True))
            if i + count < len(keys):
                known[i + count] = False
        return known[i]

    return present


def _whole_hit_asked(manager: Any, parts: tuple[ChunkPart, ...], keys: list[list[Any]], hit: int, chunk_size: int,
                     search_range: list[str] | None, pinned: dict[str, list[Any]] | None) -> list[dict[int, bool]]:
    """What one question for every object a hit of ``hit`` tokens needs (every part's, in one ``_held_run``)
    tells of each part's chunks, by index: all of them held, usually; else those up to the first missing one,
    and that one missing."""
    wanted = [(p, i) for p, part in enumerate(parts) for i in needed_chunks(part.reach, hit, chunk_size)]
    held, where = _held_run(manager, [keys[p][i] for p, i in wanted], search_range, pinned is not None)
    _record(pinned, where)
    known: list[dict[int, bool]] = [{} for _ in parts]
    for p, i in wanted[:held]:
        known[p][i] = True
    if held < len(wanted):
        p, i = wanted[held]
        known[p][i] = False
    return known


def _record(into: dict[str, list[Any]] | None, where: Mapping[str, list[Any]]) -> None:
    """Add ``where``'s keys (by tier) to ``into``, unless it is None (a lookup that does not pin)."""
    if into is not None:
        for location, held in where.items():
            into.setdefault(location, []).extend(held)


def _lookup(engine: Any, parts: tuple[ChunkPart, ...], chunk_size: int, tokens: Any = None,
            hashes: Any = None, offsets: Any = None, search_range: list[str] | None = None,
            lookup_id: str | None = None, pin: bool = False, request_configs: dict | None = None) -> int:
    """The longest hit every part can serve; with ``pin``, its objects are pinned under ``lookup_id``: pinned as
    they are asked (no second question, and none can vanish in between), those the hit does not need unpinned."""
    if pin and lookup_id is None:
        raise ValueError("lookup_id is required when pin is True")
    if not engine.is_healthy():
        return 0
    manager = engine.storage_manager
    search_range = engine.retrieve_locations if search_range is None else search_range
    keys, ends = [], []
    for part in parts:
        chunks = list(engine.token_database.process_tokens(tokens=tokens, hashes=hashes, offsets=offsets,
                                                           request_configs=part_configs(request_configs, part)))
        keys.append([key for _, _, key in chunks])
        ends = [end for _, end, _ in chunks]
    stats = engine.stats_monitor.on_lookup_request(ends[-1] if ends else 0)
    hit = 0
    pinned: dict[str, list[Any]] | None = {} if pin else None
    try:
        # The whole prompt's hit asked first, in one question (on a remote store, one round trip); a part that
        # misses a chunk is then asked on from where that question left it. Held in any tiers: the load reads
        # each object where this lookup found and pinned it.
        known = _whole_hit_asked(manager, parts, keys, ends[-1] if ends else 0, chunk_size, search_range, pinned)
        hit = longest_hit([(part.reach, _asked_in_runs(manager, part_keys, search_range, pinned, part_known))
                           for part, part_keys, part_known in zip(parts, keys, known, strict=True)], ends)
        return hit
    finally:
        engine.stats_monitor.on_lookup_finished(stats, hit)
        if pinned is not None:
            _keep_needed(engine, parts, keys, hit, chunk_size, pinned, lookup_id)
            manager.touch_cache()


def _keep_needed(engine: Any, parts: tuple[ChunkPart, ...], keys: list[list[Any]], hit: int, chunk_size: int,
                 pinned: dict[str, list[Any]], lookup_id: str | None) -> None:
    """Of the objects a lookup pinned, keep those its hit needs pinned under ``lookup_id``; unpin the others
    (all of them for no hit, or when the lookup raised)."""
    needed = {part_keys[i] for part, part_keys in zip(parts, keys, strict=True)
              for i in needed_chunks(part.reach, hit, chunk_size)} if hit else set()
    kept: dict[str, list[Any]] = {}
    for location, held in pinned.items():
        extra = [key for key in held if key not in needed]
        if extra:
            engine.storage_manager.batched_unpin(extra, [location])
        if mine := [key for key in held if key in needed]:
            kept[location] = mine
    if kept:
        engine.lookup_pins[lookup_id] = kept
