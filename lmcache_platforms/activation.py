"""What ``import lmcache_platforms`` does: choose the platform, apply the patch catalog, register our vLLM
connectors when vLLM's connector factory is imported. Once per process, thread-safe, one summary log line."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import wrapt

from lmcache_platforms.integration.vllm import readiness
from lmcache_platforms.log import init_logger
from lmcache_platforms.patching.registry import PatchRegistry
from lmcache_platforms.patching.versions import UnsupportedUpstreamVersion
from lmcache_platforms.upstream_fixes.catalog import PATCHES

logger = init_logger(__name__)

DISABLE_ENV = "LMCACHE_PLATFORMS_DISABLE"
ALLOW_UNKNOWN_ENV = "LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS"
VLLM_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
LMCACHE_DEVICE_BACKEND_ENV = "LMCACHE_DEVICE_BACKEND"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass
class Activation:
    """The state of this process's activation, as ``status()`` reports it."""

    activated: bool = False
    disabled: bool = False
    platform: str | None = None
    error: str | None = None
    registry: PatchRegistry | None = None
    connectors: dict[str, Any] = field(default_factory=lambda: {"state": "waiting for vLLM", "names": []})

    def as_dict(self) -> dict[str, Any]:
        from lmcache_platforms.integration.vllm.health import engine_health

        return {
            "activated": self.activated,
            "disabled": self.disabled,
            "platform": self.platform,
            "error": self.error,
            "patches": self.registry.report() if self.registry else [],
            "connectors": dict(self.connectors),
            "engines": engine_health(),
        }


_lock = threading.RLock()
_state: Activation | None = None


def activate() -> Activation:
    """Activate once; later calls return the same state. Raises UnsupportedUpstreamVersion (nothing applied)
    when upstream is a version our patches do not know, unless LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=1."""
    global _state
    with _lock:
        if _state is not None and (_state.activated or _state.disabled):
            return _state
        state = Activation()
        if _flag(DISABLE_ENV):
            state.disabled = True
            _state = state
            logger.info("lmcache_platforms disabled by %s=1: nothing patched or registered", DISABLE_ENV)
            return state
        from lmcache_platforms.platforms.detect import current_platform

        try:
            platform = current_platform()
            state.platform = platform.name
            _select_lmcache_device_backend(platform.lmcache_device_backend)
            state.registry = PatchRegistry(PATCHES, allow_unknown_versions=_flag(ALLOW_UNKNOWN_ENV))
            state.registry.apply()
        except Exception as exc:
            state.error = f"{type(exc).__name__}: {exc}"
            _state = state
            raise
        state.activated = True
        _state = state
        # Only now: wrapt runs the hook at once when vLLM's factory is already imported, and the hook acts
        # only for an activated state (registering first lost our names whenever vLLM was imported first).
        wrapt.register_post_import_hook(_register_connectors, VLLM_FACTORY)
        # Quiet in a process that never builds a vLLM engine (a script, the command-line tool): the summary goes
        # out at INFO with the connectors' registration below, where vLLM imports its factory.
        logger.debug("lmcache_platforms activated: %s", summary(state))
        return state


def _select_lmcache_device_backend(backend: str | None, environ: MutableMapping[str, str] = os.environ) -> None:
    """Make LMCache pick our DeviceSpec where we add one (upstream's is also "available" there and LMCache
    refuses to choose between two); a value the user set is kept."""
    if backend is None:
        return
    chosen = environ.setdefault(LMCACHE_DEVICE_BACKEND_ENV, backend)
    if chosen != backend:
        logger.info("%s=%s set by the user; lmcache_platforms' device plugin %s is not used",
                    LMCACHE_DEVICE_BACKEND_ENV, chosen, backend)


def _register_connectors(_factory_module: Any) -> None:
    """Post-import hook on vLLM's connector factory: add our connector names to it."""
    from lmcache_platforms.integration.vllm.registration import register_connectors

    state = _state
    if state is None or not state.activated:
        return
    try:
        names = register_connectors()
    except Exception as exc:  # noqa: BLE001 - vLLM must still start; the failure is logged and reported
        state.connectors = {"state": "failed", "names": [], "detail": f"{type(exc).__name__}: {exc}"}
        logger.error("lmcache_platforms could not register its vLLM connectors: %s", state.connectors["detail"])
        return
    state.connectors = {"state": "registered", "names": list(names)}
    logger.info("lmcache_platforms activated: %s", summary(state))


def summary(state: Activation) -> str:
    """One line: platform and patch counts by state."""
    counts: dict[str, int] = {}
    for entry in state.registry.report() if state.registry else []:
        counts[entry["state"]] = counts.get(entry["state"], 0) + 1
    patches = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none declared"
    names = ", ".join(state.connectors.get("names", ()))
    return (f"platform={state.platform}; patches: {patches}; vLLM connectors: {state.connectors['state']}"
            + (f" ({names})" if names else ""))


def describe() -> str:
    """This process's activation in one line, as its summary is logged."""
    with _lock:
        if _state is None:
            return "not attempted"
        if _state.disabled:
            return f"disabled by {DISABLE_ENV}=1"
        return summary(_state) if _state.activated else f"failed: {_state.error}"


def status() -> dict[str, Any]:
    """What activation did in this process (activating first if nobody has)."""
    with _lock:
        if _state is None:
            with contextlib.suppress(UnsupportedUpstreamVersion):
                activate()
        assert _state is not None
        return _state.as_dict()


def ensure_patched() -> Activation:
    """For code that relies on the patches (building our connector): activate if needed, apply patches whose
    modules finished importing meanwhile, and refuse to run on unpatched upstream."""
    state = activate()
    if state.disabled:
        raise RuntimeError(f"lmcache_platforms is disabled ({DISABLE_ENV}=1), so its connector cannot run: "
                           f"unset {DISABLE_ENV} or configure another connector")
    assert state.registry is not None
    state.registry.retry()
    if state.registry.failed:
        reasons = "; ".join(f"{r.patch.target}: {r.detail}" for r in state.registry.failed)
        raise RuntimeError(f"lmcache_platforms patches failed, nothing is patched: {reasons}")
    return state


readiness.install(ensure_patched)


def current_registry() -> PatchRegistry | None:
    """The patch registry of this process's activation (None before activation or when disabled)."""
    with _lock:
        return _state.registry if _state is not None else None


def activate_or_log() -> Activation | None:
    """Activation for the package's import, which must go on without it: the error is logged once and kept for
    ``status()``; our connector refuses to run later with the reason."""
    try:
        return activate()
    except Exception as exc:  # noqa: BLE001 - the host process must keep running; status() carries it
        logger.error("lmcache_platforms not activated: %s", exc)
        return None


def vllm_plugin() -> None:
    """Entry point ``vllm.general_plugins``: vLLM calls it in every process it starts (API server, engine
    core, workers). Importing this module to find it imported the package, which activated (or logged why
    not), so nothing is left to do: trying again would only log the same error twice."""


def reset_for_tests() -> None:
    """Undo activation (roll back patches) so a test can activate again under other conditions."""
    global _state
    with _lock:
        if _state is not None and _state.registry is not None:
            _state.registry.rollback()
        _state = None
