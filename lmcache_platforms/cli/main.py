"""`lmcache-platforms`: one console script, one module per subcommand, imported only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "doctor": "what is installed, activated and usable here",
    "stats": "a server's connector statistics from /metrics: hit rate, bytes, time, failed loads",
    "plan": "what a layout file transfers per chunk",
    "bench": "transfer speed of a layout against memcpy",
    "selftest": "store and reload a layout through a real LMCacheEngine, bit for bit",
    "demo": "vLLM serving a hybrid model with LMCache prefix reuse, cold vs warm",
    "soak": "concurrent clients against vllm serve with constant eviction: failures, pins, RSS, same answers",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-platforms", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"lmcache_platforms.cli.{name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Importing this module activated the package (``lmcache_platforms/__init__.py``), as any import of it does."""
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"lmcache_platforms.cli.{args.command}")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
