"""Our settings: read once from LMCache's config (``extra_config``), the environment and vLLM's
``kv_connector_extra_config``.

LMCache's own config class cannot take new keys without being rebuilt, so ours live in ``extra_config``: the
``extra_config:`` section of LMCache's yaml (``LMCACHE_CONFIG_FILE``), or ``LMCACHE_EXTRA_CONFIG`` (JSON), which
LMCache lets replace the yaml's section whole, not merge into it. An environment variable of ours
(``LMCACHE_PLATFORMS_*``), where one exists, wins over ``extra_config`` so one run can be changed without editing
the file; a ``platforms.*`` key in vLLM's ``--kv-transfer-config`` ``kv_connector_extra_config`` wins over both,
because it is given for this very engine. Precedence, highest first: kv_connector_extra_config, environment,
extra_config, default. ``resolve`` is that rule, with where each value came from (``lmcache-platforms doctor``
shows it); ``PlatformSettings.load`` keeps the values.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

MODES = ("bundled", "exploded")
LOAD_MODES = ("async", "sync")
CHUNK_PARTS = ("window", "whole")
CHUNK_ROWS = ("blocks", "tokens")
SETTINGS_PREFIX = "platforms."
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"  # LMCache's yaml


@dataclass(frozen=True)
class Setting:
    """One documented switch: its ``extra_config`` key, environment variable, default and meaning (``doc``, Markdown:
    docs/configuration.md is generated from these declarations by scripts/config_docs.py)."""

    key: str
    env: str
    default: Any
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting("platforms.mode", "LMCACHE_PLATFORMS_MODE", "bundled",
            "`bundled`: one kernel launch per KV-cache group per chunk; `exploded`: one per (group, plane "
            "geometry)"),
    Setting("platforms.kernel_backend", "LMCACHE_PLATFORMS_KERNEL_BACKEND", "auto",
            "`auto` (the fastest available for the device), or one of `torch`, `cpu`, `triton`, `ascend`"),
    Setting("platforms.state_markers", "LMCACHE_PLATFORMS_STATE_MARKERS", "State",
            "comma list: a group whose KV-cache spec class name contains one of these is a state group, not saved"),
    Setting("platforms.save_groups", "LMCACHE_PLATFORMS_SAVE_GROUPS", "",
            "comma list of spec class names or group indices always saved, even if they look like state"),
    Setting("platforms.skip_groups", "LMCACHE_PLATFORMS_SKIP_GROUPS", "",
            "comma list of spec class names or group indices never saved"),
    Setting("platforms.load_mode", "LMCACHE_PLATFORMS_LOAD_MODE", "sync",
            "`sync`: the engine step waits for a hit's load (faster for requests that arrive one by one); "
            "`async`: the step goes on and other requests run while the load is in flight (see "
            "[reliability](reliability.md#load-modes))"),
    Setting("platforms.load_timeout_s", "LMCACHE_PLATFORMS_LOAD_TIMEOUT_S", 10.0,
            "a load still running after this many seconds is reported failed and its late writes are refused; "
            "`0` waits for ever"),
    Setting("platforms.remote_lookup_timeout_s", "LMCACHE_PLATFORMS_REMOTE_LOOKUP_TIMEOUT_S", 1.0,
            "a remote store's answer to \"do you hold this chunk?\" is waited for this long, then the chunk counts "
            "as a miss; keep it below LMCache's `lookup_timeout_ms` (3 s), after which the scheduler stops waiting "
            "anyway; `0` waits for ever (see [reliability](reliability.md#stuck-remote-store))"),
    Setting("platforms.remote_connect_timeout_s", "LMCACHE_PLATFORMS_REMOTE_CONNECT_TIMEOUT_S", 2.5,
            "the first lookup on a remote store's connection (at start, and after LMCache re-creates a lost one) "
            "is waited for this long instead, since it pays for connecting (a Redis Cluster client discovers its "
            "slots then); never less than `platforms.remote_lookup_timeout_s`; keep it below `lookup_timeout_ms` "
            "too"),
    Setting("platforms.remote_retry_s", "LMCACHE_PLATFORMS_REMOTE_RETRY_S", 30.0,
            "after a remote lookup timed out, lookups count the remote store's chunks as misses until its late "
            "answer arrives, then for twice its lateness (four times after a second time-out in a row, and so on), "
            "never longer than this after the time-out; the next lookup then asks it again"),
    Setting("platforms.drain_timeout_s", "LMCACHE_PLATFORMS_DRAIN_TIMEOUT_S", 30.0,
            "at shutdown, chunk writes still in flight to LMCache's disk or remote store are waited for this long; "
            "what is left will miss"),
    Setting("platforms.remote_close_timeout_s", "LMCACHE_PLATFORMS_REMOTE_CLOSE_TIMEOUT_S", 5.0,
            "at shutdown, closing the remote store's connection is waited for this long, then the engine goes on "
            "closing without it; `0` waits for ever"),
    Setting("platforms.chunk_parts", "LMCACHE_PLATFORMS_CHUNK_PARTS", "window",
            "`window`: a model with sliding-window or snapshot groups beside full attention stores each chunk as "
            "one LMCache object per part (full attention; each window; snapshots) under part-tagged keys, and a "
            "load reads a window part only for the chunks its window needs (the demo model's warm load: 2.7x fewer "
            "bytes, same stored bytes); a hit still needs every part it reads. `whole`: one object per chunk (also "
            "used, with a log line saying why, when a remote store keeps "
            "no per-object metadata, e.g. `save_chunk_meta: false`). Changing it changes the keys: chunks stored "
            "under the other setting miss"),
    Setting("platforms.chunk_rows", "LMCACHE_PLATFORMS_CHUNK_ROWS", "blocks",
            "`blocks`: where chunks are saved whole (several saved groups, or a snapshot group), a group whose "
            "blocks a chunk covers whole (chunk size, and window if any, multiples of its block tokens) is moved "
            "one block row per block: each plane's page of the block as one row, a layer's planes merged where "
            "they tile its page (vLLM's CPU cache: one 64 KiB copy per layer and block instead of 2,048 short "
            "pieces); same bytes per chunk in another order. `tokens`: one row per token (or compressed row) "
            "everywhere, as LMCache does. Changing it changes the keys: chunks stored under the other setting "
            "miss"),
    Setting("platforms.poison_loads", "LMCACHE_PLATFORMS_POISON_LOADS", False,
            "**tests only**: before a load writes a request's blocks, every row of them (every group, layer and "
            "plane the connector moves) is filled with random finite values, so a row the load should write and "
            "does not changes the answer instead of keeping its previous owner's bytes; costs a write of the "
            "blocks per load. The suite and the fuzzer (`make fuzz`) run with it on"),
    Setting("platforms.model_revision", "LMCACHE_PLATFORMS_MODEL_REVISION", "",
            "every chunk key carries the model's identity: a hash of its config as vLLM sees it and of its "
            "weights, identified without reading them (a file in the Hugging Face cache by its blob's content "
            "hash, any other by its size and modification time: a copy that did not keep the times shares "
            "nothing). This setting, when given, names the weights instead of their files (e.g. a checkpoint's "
            "hash): servers given the same value share chunks, so it must change whenever the weights do. The "
            "engine's start-up log line shows the identity"),
)


def env_name(key: str) -> str:
    """The environment variable of the setting ``key`` (``platforms.*``)."""
    return next(s.env for s in SETTINGS if s.key == key)


_ALLOWED: dict[str, tuple[str, ...]] = {"platforms.mode": MODES, "platforms.load_mode": LOAD_MODES,
                                         "platforms.chunk_parts": CHUNK_PARTS, "platforms.chunk_rows": CHUNK_ROWS}


def _as_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        return (str(value),)  # a yaml list of one group index, written without brackets
    return tuple(str(v) for v in value)


def _check_keys(source: str, keys: Iterable[str]) -> None:
    """Refuse a ``platforms.*`` key we do not have, or another key a typo away from one of ours (``platform.``,
    ``platfroms.``), naming the nearest: a typo must not be ignored. Other keys belong to others."""
    known = [s.key for s in SETTINGS]
    for key in keys:
        if key in known:
            continue
        ours = key.startswith(SETTINGS_PREFIX)
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6 if ours else 0.85)
        if ours or near:
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(known)}"
            raise ValueError(f"unknown setting {key!r} in {source}{hint}")


def check_config_file(path: str | None) -> None:
    """Refuse one of our keys at the top level of LMCache's yaml (``LMCACHE_CONFIG_FILE``): LMCache warns about a
    key it does not know and drops it, so the setting would not apply. An unreadable file is LMCache's to report."""
    if not path:
        return
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return
    for key in data if isinstance(data, dict) else ():
        if isinstance(key, str) and key.startswith(SETTINGS_PREFIX):
            raise ValueError(f"{key!r} is at the top level of {path}, where LMCache ignores it: our settings go "
                             f"under extra_config (extra_config: {{{key}: {data[key]}}})")


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


def _convert(key: str, default: Any, raw: Any) -> Any:
    """``raw`` as the type of the setting's default (a tuple for lists, a bool for switches, a non-negative
    float for numbers)."""
    if isinstance(default, tuple):
        return _as_list(raw)
    if isinstance(default, bool):
        word = str(raw).strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{key} must be true or false, got {raw!r}")
        return word in _TRUE
    if isinstance(default, float):
        if isinstance(raw, bool):
            raise ValueError(f"{key} must be a number of seconds, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number of seconds, got {raw!r}") from None
        if not value >= 0:
            raise ValueError(f"{key} must be >= 0, got {raw!r}")
        return value
    return str(raw)


@dataclass(frozen=True)
class PlatformSettings:
    """Resolved values of SETTINGS; build with ``PlatformSettings.load``."""

    mode: str = "bundled"
    kernel_backend: str = "auto"
    state_markers: tuple[str, ...] = ("State",)
    save_groups: tuple[str, ...] = ()
    skip_groups: tuple[str, ...] = ()
    load_mode: str = "sync"
    load_timeout_s: float = 10.0
    remote_lookup_timeout_s: float = 1.0
    remote_connect_timeout_s: float = 2.5
    remote_retry_s: float = 30.0
    drain_timeout_s: float = 30.0
    remote_close_timeout_s: float = 5.0
    chunk_parts: str = "window"
    chunk_rows: str = "blocks"
    poison_loads: bool = False
    model_revision: str = ""

    @classmethod
    def load(
        cls,
        extra_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> PlatformSettings:
        """The values ``resolve`` finds (its precedence and checks)."""
        values = {field.name: r.value for field, r in zip(fields(cls), resolve(extra_config, env, overrides),
                                                          strict=True)}
        return cls(**values)


@dataclass(frozen=True)
class Resolved:
    """One setting's effective value and where it came from: ``kv_connector_extra_config``, ``env`` (its
    variable), the ``extra_config`` source's name, or ``default``."""

    setting: Setting
    value: Any
    source: str


def resolve(
    extra_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_source: str = "extra_config",
) -> list[Resolved]:
    """Every setting from ``overrides`` (vLLM's ``kv_connector_extra_config``; only ``platforms.*`` keys are ours),
    else the environment, else ``extra_config`` (named ``extra_source`` where it came from), else the default;
    raise ValueError, naming the key, for a key we do not have or a value a setting cannot take."""
    extra = dict(extra_config or {})
    override = {k: v for k, v in (overrides or {}).items() if k.startswith(SETTINGS_PREFIX)}
    _check_keys("LMCache's extra_config", extra)
    _check_keys("vLLM's kv_connector_extra_config", override)
    environ = os.environ if env is None else env
    resolved = []
    for setting, field in zip(SETTINGS, fields(PlatformSettings), strict=True):
        if setting.key in override:
            raw, source = override[setting.key], "kv_connector_extra_config"
        elif setting.env in environ:
            raw, source = environ[setting.env], "env"
        elif setting.key in extra:
            raw, source = extra[setting.key], extra_source
        else:
            raw, source = setting.default, "default"
        resolved.append(Resolved(setting, _convert(setting.key, field.default, raw), source))
    for r in resolved:
        allowed = _ALLOWED.get(r.setting.key)
        if allowed is not None and r.value not in allowed:
            raise ValueError(f"{r.setting.key} must be one of {', '.join(allowed)}, got {r.value!r}")
    return resolved


def connector_settings(lmcache_config: Any, kv_connector_extra_config: Mapping[str, Any] | None) -> PlatformSettings:
    """Settings of one engine from LMCache's config object and vLLM's ``kv_connector_extra_config`` (None
    outside vLLM). The GPU connector and the vLLM engine impl must both read them this way, or a key given
    to vLLM would reach one and not the other."""
    check_config_file(os.environ.get(CONFIG_FILE_ENV))
    return PlatformSettings.load(getattr(lmcache_config, "extra_config", None), overrides=kv_connector_extra_config)
