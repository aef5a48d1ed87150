"""Our settings: read once from LMCache's config (``extra_config``) with environment overrides.

LMCache's own config class cannot take new keys without being rebuilt, so ours live in ``extra_config``
(yaml ``extra_config:`` section, or ``LMCACHE_EXTRA_CONFIG``). An environment variable, where one exists,
wins over the config file so one run can be changed without editing it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MODES = ("bundled", "exploded")


@dataclass(frozen=True)
class Setting:
    """One documented switch: its ``extra_config`` key, environment variable and default."""

    key: str
    env: str
    default: Any
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting("platforms.mode", "LMCACHE_PLATFORMS_MODE", "bundled",
            "bundled: one kernel launch per KV group; exploded: one per (group, plane geometry)"),
    Setting("platforms.kernel_backend", "LMCACHE_PLATFORMS_KERNEL_BACKEND", "auto",
            "auto (fastest available), or one of torch, cpu, triton, ascend"),
    Setting("platforms.state_markers", "LMCACHE_PLATFORMS_STATE_MARKERS", "State",
            "comma list: a KV-cache spec whose class name contains one of these is a state group"),
    Setting("platforms.save_groups", "LMCACHE_PLATFORMS_SAVE_GROUPS", "",
            "comma list of spec class names or group indices always saved, even if they look like state"),
    Setting("platforms.skip_groups", "LMCACHE_PLATFORMS_SKIP_GROUPS", "",
            "comma list of spec class names or group indices never saved"),
)


def _as_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(str(v) for v in value)


@dataclass(frozen=True)
class PlatformSettings:
    """Resolved values of SETTINGS; build with ``PlatformSettings.load``."""

    mode: str = "bundled"
    kernel_backend: str = "auto"
    state_markers: tuple[str, ...] = ("State",)
    save_groups: tuple[str, ...] = ()
    skip_groups: tuple[str, ...] = ()

    @classmethod
    def load(
        cls, extra_config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> PlatformSettings:
        """Read every setting from ``extra_config`` then the environment; reject unknown values."""
        extra = dict(extra_config or {})
        environ = os.environ if env is None else env
        values: dict[str, Any] = {}
        for setting, field in zip(SETTINGS, fields(cls), strict=True):
            raw = environ.get(setting.env, extra.get(setting.key, setting.default))
            values[field.name] = _as_list(raw) if isinstance(field.default, tuple) else str(raw)
        if values["mode"] not in MODES:
            raise ValueError(f"platforms.mode must be one of {', '.join(MODES)}, got {values['mode']!r}")
        return cls(**values)
