"""Report what is installed, which patches are applied, which kernel backends and platforms are usable.

Doctor imports every upstream module the patch catalog targets (LMCache, vLLM: a few seconds), and vLLM's
connector factory, so each patch is really applied, or fails, in this process and the factory shows our names.

Exit 1, with the reason, when activation failed, an applicable patch failed, or an LMCache engine of this
process runs in upstream's silent "degraded mode" (``lmcache_platforms.status()`` carries the same)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform as pyplatform
import sys
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


def adapter_in_effect(patches: list[dict[str, Any]]) -> str:
    """Which engine impl LMCache's upstream connector names (vLLM's LMCacheConnectorV1, LMCache's
    LMCacheConnectorV1Dynamic) run in this process."""
    entry = next((p for p in patches if p["target"] == UPSTREAM_ADAPTER), None)
    if entry is None or entry["state"] in ("pending", "applied"):
        return "ours: upstream connector names run lmcache_platforms' engine impl"
    return f"upstream's: only LMCachePlatformsConnector runs lmcache_platforms' engine impl ({entry['detail']})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def collect() -> dict[str, Any]:
    """Everything doctor reports, as one JSON-ready dict."""
    import lmcache_platforms
    from lmcache_platforms.connector.instance_adapter import INSTANCE_CHANGES
    from lmcache_platforms.kernels.registry import describe_backends, preferred_backend
    from lmcache_platforms.patching.versions import installed_version
    from lmcache_platforms.platforms.detect import describe_platforms

    registry = lmcache_platforms.activation.current_registry()
    if registry is not None:
        registry.import_targets()
        if importlib.util.find_spec("vllm") is not None:  # our names are registered once its factory is imported
            importlib.import_module(lmcache_platforms.activation.VLLM_FACTORY)
    state = lmcache_platforms.status()
    versions: dict[str, str | None] = {"python": pyplatform.python_version()}
    versions.update({key: installed_version(name) for key, name in VERSIONED.items()})
    return {
        "activated": state["activated"],
        "disabled": state["disabled"],
        "error": state["error"],
        "platform": state["platform"] or "unknown",
        "versions": versions,
        "platforms": [{**p, "default_kernel_backend": preferred_backend(str(p["name"]))} for p in describe_platforms()],
        "kernel_backends": describe_backends(),
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


def _print_table(report: dict[str, Any]) -> None:
    print(f"activated: {report['activated']}   platform: {report['platform']}")
    print("versions: " + ", ".join(f"{k}={v}" for k, v in report["versions"].items()))
    for p in report["platforms"]:
        print(f"platform {p['name']:5s} {'yes' if p['available'] else 'no ':3s}  {p['reason']}")
    for b in report["kernel_backends"]:
        print(f"kernels  {b['name']:7s} {'yes' if b['available'] else 'no ':3s}  {b['reason']}")
    for p in report["patches"]:
        print(f"patch    {p['target']}  {p['detail']}")
    for c in report["instance_changes"]:
        print(f"instance {c['target']}  when {c['when']}: {c['why']}")
    print(f"vLLM connectors: {report['connectors']}")
    print(f"upstream adapter: {report['upstream_adapter']}")
    engines = report["engines"] or [{"role": "-", "stage": "-", "degraded": False, "reason": "none in this process"}]
    for e in engines:
        print(f"engine   {e['role']} {'DEGRADED' if e['degraded'] else 'ok'} {e['stage']} {e['reason']}")


def run(args: argparse.Namespace) -> int:
    report = collect()
    found = problems(report)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    for line in found:
        print(f"doctor: {line}", file=sys.stderr)
    return 1 if found else 0
