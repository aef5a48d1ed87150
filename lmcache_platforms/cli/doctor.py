"""Report what is installed, the settings in force and where each comes from, which patches are applied, which
kernel backends and platforms are usable, and whether the hash seed lets servers share chunks.

By default doctor answers in a few seconds from what activation found (versions, platform, settings, each patch
pending until its module is imported). ``--deep`` proves in this process what a server would meet: it imports
vLLM's connector factory (so the factory shows our names) and every upstream module the patch catalog targets
(so each patch is really applied, or fails). Those imports (transformers, vLLM, LMCache) take ten seconds and
more, so each step is announced on stderr as it starts. Settings are read first: an invalid one ends doctor at
once with its one-line reason.

Exit 1, with the reason, when a setting is invalid, activation failed, an applicable patch failed, or an LMCache
engine of this process runs in upstream's silent "degraded mode" (``lmcache_platforms.status()`` carries the same).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform as pyplatform
import sys
import time
from collections.abc import Mapping
from typing import Any

VERSIONED = {
    "torch": "torch",
    "lmcache": "lmcache",
    "vllm": "vllm",
    "vllm_ascend": "vllm_ascend",
    "torch_npu": "torch_npu",
    "ipex": "intel_extension_for_pytorch",
    "triton": "triton",
}

UPSTREAM_ADAPTER = "lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl"
EXTRA_CONFIG_ENV = "LMCACHE_EXTRA_CONFIG"
HASH_SEED_ENV = "PYTHONHASHSEED"


def adapter_in_effect(patches: list[dict[str, Any]]) -> str:
    """Which engine impl LMCache's upstream connector names (vLLM's LMCacheConnectorV1, LMCache's
    LMCacheConnectorV1Dynamic) run in this process."""
    entry = next((p for p in patches if p["target"] == UPSTREAM_ADAPTER), None)
    if entry is None or entry["state"] in ("pending", "applied"):
        return "ours: upstream connector names run lmcache_platforms' engine impl"
    return f"upstream's: only LMCachePlatformsConnector runs lmcache_platforms' engine impl ({entry['detail']})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--deep", action="store_true",
                        help="import vLLM's connector factory and every patch target here, proving each patch "
                             "applies and our connector names register (ten seconds and more)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every patch, every method replaced on live LMCache objects, and why each "
                             "platform or kernel backend is not usable")
    parser.add_argument("--kv-transfer-config", metavar="JSON",
                        help="the JSON given to vllm serve's --kv-transfer-config: its kv_connector_extra_config "
                             "platforms.* keys win over every other source")


def hash_seed(environ: Mapping[str, str]) -> dict[str, Any]:
    """Whether Python's string hash is fixed: LMCache's chunk keys use it, so servers sharing a store (and one
    server across restarts) find each other's chunks only with the same fixed PYTHONHASHSEED."""
    seed = environ.get(HASH_SEED_ENV) or None  # Python reads an empty value as unset
    fixed = seed not in (None, "random")
    warning = None if fixed else (
        f"{HASH_SEED_ENV} is {'unset' if seed is None else 'random'}: LMCache's chunk keys use Python's hash(), so "
        "chunks stored by one process miss in another (no hits across restarts or servers); export "
        f"{HASH_SEED_ENV}=0 (or any fixed value) for every server sharing a store")
    return {HASH_SEED_ENV: seed, "fixed": fixed, "warning": warning}


def _lmcache_extra_config() -> tuple[Mapping[str, Any] | None, str]:
    """LMCache's ``extra_config`` read as its vLLM integration reads it (the yaml named by LMCACHE_CONFIG_FILE,
    then its LMCACHE_* variables, where LMCACHE_EXTRA_CONFIG replaces the yaml's section), and its source."""
    source = EXTRA_CONFIG_ENV if os.environ.get(EXTRA_CONFIG_ENV) else "yaml"
    if importlib.util.find_spec("lmcache") is None:  # a machine without LMCache: no extra_config to read
        return None, source
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_platforms.config import CONFIG_FILE_ENV, check_config_file

    path = os.environ.get(CONFIG_FILE_ENV)
    check_config_file(path)
    config = LMCacheEngineConfig.from_file(path).update_config_from_env() if path else LMCacheEngineConfig.from_env()
    return config.extra_config, source


def settings(kv_transfer_config: str | None) -> dict[str, dict[str, Any]]:
    """Every setting's effective value and source, by ``config.resolve`` (the precedence the connector uses).
    Raises ValueError (or LMCache's error for its own config) with a one-line reason."""
    from lmcache_platforms.config import resolve

    overrides = None
    if kv_transfer_config is not None:
        try:
            transfer = json.loads(kv_transfer_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(transfer, dict) or not isinstance(transfer.get("kv_connector_extra_config", {}), dict):
            raise ValueError("--kv-transfer-config must be a JSON object whose kv_connector_extra_config is one")
        overrides = transfer.get("kv_connector_extra_config")
    extra, extra_source = _lmcache_extra_config()
    return {r.setting.key: {"value": list(r.value) if isinstance(r.value, tuple) else r.value, "source": r.source}
            for r in resolve(extra, overrides=overrides, extra_source=extra_source)}


def _step(what: str, started: float) -> None:
    print(f"doctor: {what} ({time.monotonic() - started:.1f} s)...", file=sys.stderr, flush=True)


def collect(started: float, deep: bool = True) -> dict[str, Any]:
    """Everything doctor reports but the settings and the hash seed, as one JSON-ready dict; ``deep``: after
    importing vLLM's connector factory, then every patch target (steps announced on stderr)."""
    import lmcache_platforms
    from lmcache_platforms.connector import checksum
    from lmcache_platforms.connector.instance_changes import INSTANCE_CHANGES
    from lmcache_platforms.kernels.registry import describe_backends, preferred_backend
    from lmcache_platforms.patching.versions import installed_version
    from lmcache_platforms.platforms.detect import describe_platforms

    registry = lmcache_platforms.activation.current_registry()
    if registry is not None and deep:
        if importlib.util.find_spec("vllm") is not None:  # our names are registered once its factory is imported
            _step("importing vLLM's connector factory", started)
            importlib.import_module(lmcache_platforms.activation.VLLM_FACTORY)
        _step("importing the patch targets", started)
        registry.import_targets()
    state = lmcache_platforms.status()
    versions: dict[str, str | None] = {"python": pyplatform.python_version()}
    versions.update({key: installed_version(name) for key, name in VERSIONED.items()})
    return {
        "version": lmcache_platforms.__version__,
        "activated": state["activated"],
        "disabled": state["disabled"],
        "error": state["error"],
        "platform": state["platform"] or "unknown",
        "versions": versions,
        "platforms": [{**p, "default_kernel_backend": preferred_backend(str(p["name"]))} for p in describe_platforms()],
        "kernel_backends": describe_backends(),
        "checksum_hashing": checksum.hashing(),
        "patches": [{"target": p["target"], "applied": p["applied"], "detail": f"{p['state']}: {p['detail']}"}
                    for p in state["patches"]],
        "instance_changes": [{"target": f"{change.target}.{method}", "when": change.when, "why": change.why}
                             for change in INSTANCE_CHANGES for method in change.methods],
        "connectors": state["connectors"],
        "upstream_adapter": adapter_in_effect(state["patches"]) if state["activated"] else "upstream's (not activated)",
        "engines": state["engines"],
    }


def problems(report: dict[str, Any]) -> list[str]:
    """Why doctor exits 1: activation errors and failed applicable patches."""
    found = []
    if report["error"]:
        found.append(f"activation failed: {report['error']}")
    found += [f"patch {p['target']}: {p['detail']}" for p in report["patches"] if p["detail"].startswith("failed")]
    found += [f"LMCache engine of the {e['role']} is in degraded mode ({e['stage']}: {e['reason']})"
              for e in report.get("engines", []) if e["degraded"]]
    if report["connectors"].get("state") == "failed":
        found.append(f"vLLM connector registration failed: {report['connectors'].get('detail')}")
    return found


def _value_text(value: Any) -> str:
    """A setting's value as a user writes it (lists comma-separated, switches true/false)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value) or "(empty)"
    return str(value) if value != "" else "(empty)"


def _source_text(key: str, source: str) -> str:
    from lmcache_platforms.config import CONFIG_FILE_ENV, env_name

    if source == "env":
        return f"env {env_name(key)}"
    if source == "yaml":
        return f"yaml {os.environ.get(CONFIG_FILE_ENV)}"
    return source


def _print_text(report: dict[str, Any], verbose: bool) -> None:
    installed = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v is not None)
    print(f"lmcache_platforms {report['version']} ({installed})")
    print(f"activated: {'yes' if report['activated'] else 'no'}   platform: {report['platform']}")
    usable = [p for p in report["platforms"] if p["available"]]
    print("platforms usable: " + (", ".join(f"{p['name']} (kernel backend {p['default_kernel_backend']})"
                                            for p in usable) or "none"))
    print("kernel backends usable: " + (", ".join(b["name"] for b in report["kernel_backends"] if b["available"])
                                        or "none"))
    print(f"chunk checksums: {report['checksum_hashing']}")
    if verbose:
        for kind, entries in (("platform", report["platforms"]), ("kernels", report["kernel_backends"])):
            for e in entries:
                print(f"  {kind:8s} {e['name']:7s} {'yes' if e['available'] else 'no ':3s}  {e['reason']}")
    counts: dict[str, int] = {}
    for p in report["patches"]:
        state = p["detail"].split(":", 1)[0]
        counts[state] = counts.get(state, 0) + 1
    print("patches: " + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none")
          + (" (each applies when its module is imported; --deep imports them here)" if "pending" in counts else ""))
    for p in report["patches"]:
        if verbose or not (p["applied"] or p["detail"].startswith("pending")):
            state, detail = p["detail"].split(": ", 1)
            print(f"  {state}: {detail}" if p["applied"] else f"  {state}: {p['target']}: {detail}")
    print(f"methods replaced on live LMCache objects: {len(report['instance_changes'])}"
          + ("" if verbose else " (-v lists them)"))
    if verbose:
        for c in report["instance_changes"]:
            print(f"  {c['target']}  when {c['when']}: {c['why']}")
    connectors = report["connectors"]
    print(f"vLLM connectors: {connectors['state']}"
          + (f": {', '.join(connectors['names'])}" if connectors.get("names") else "")
          + (f" ({connectors['detail']})" if connectors.get("detail") else "")
          + (" (registered when vLLM imports its connector factory; --deep imports it)"
             if connectors["state"] == "waiting for vLLM" else ""))
    print(f"upstream adapter: {report['upstream_adapter']}")
    print("LMCache engines: " + ("; ".join(
        f"{e['role']} {'DEGRADED' if e['degraded'] else 'ok'} ({e['stage']}: {e['reason']})" for e in report["engines"])
        or "none in this process"))
    print("settings:")
    rows = [(key, _value_text(s["value"]), _source_text(key, s["source"])) for key, s in report["settings"].items()]
    key_width, value_width = (max(len(row[i]) for row in rows) for i in (0, 1))
    for key, value, source in rows:
        print(f"  {key:{key_width}s}  {value:{value_width}s}  {source}")
    seed = report["hash_seed"]
    if seed["fixed"]:
        print(f"hash seed: {HASH_SEED_ENV}={seed[HASH_SEED_ENV]} (fixed: servers sharing it share chunks)")
    else:
        print(f"warning: {seed['warning']}")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    # LMCache's INFO lines (a score of "Discovered API module") would bury the report; a level the user set stays.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    _step("reading settings", started)
    try:
        resolved = settings(args.kv_transfer_config)
    except Exception as exc:  # noqa: BLE001 - any invalid setting (ours or LMCache's) is one line, not a traceback
        print(f"doctor: invalid settings: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    report = {**collect(started, args.deep), "settings": resolved, "hash_seed": hash_seed(os.environ)}
    found = problems(report)
    print(f"doctor: done ({time.monotonic() - started:.1f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        _print_text(report, args.verbose)
    for line in found:
        print(f"doctor: {line}", file=sys.stderr)
    return 1 if found else 0
