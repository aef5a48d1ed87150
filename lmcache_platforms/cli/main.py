"""`lmcache-platforms`: one console script, one module per subcommand, imported only when chosen."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from types import FrameType

import lmcache_platforms
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

COMMANDS: dict[str, str] = {
    "doctor": "what is installed, activated and usable here",
    "stats": "a server's connector statistics from /metrics: hit rate, bytes, time, failed loads",
    "plan": "what a layout file transfers per chunk",
    "bench": "transfer speed of a layout against memcpy",
    "selftest": "store and reload a layout through a real LMCacheEngine, bit for bit",
    "demo": "vLLM serving a hybrid model with LMCache prefix reuse, cold vs warm",
    "soak": "concurrent clients against vllm serve with constant eviction: failures, pins, RSS, same answers",
}
# Commands that report on settings and activation themselves (doctor), or never use them (stats).
UNCHECKED = ("doctor", "stats")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-platforms", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lmcache-platforms {lmcache_platforms.__version__}")
    parser.add_argument("-v", "--verbose", dest="log_activation", action="store_true",
                        help="log what activation did (platform, patches) before the command runs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"lmcache_platforms.cli.{name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    return parser


def refusal() -> str | None:
    """Why no command may run with this process's activation and settings: a platform that does not exist, a
    setting we do not have or a value it cannot take, a kernel backend nobody provides."""
    from lmcache_platforms.config import PlatformSettings, env_name
    from lmcache_platforms.kernels.registry import backend_names

    state = lmcache_platforms.status()
    if state["error"]:
        return f"lmcache_platforms is not activated: {state['error']}"
    try:
        settings = PlatformSettings.load()
    except ValueError as exc:
        return str(exc)
    known = ["auto", *backend_names()]
    if settings.kernel_backend not in known:
        env = env_name("platforms.kernel_backend")
        return (f"platforms.kernel_backend ({env}) must be one of {', '.join(known)}, "
                f"got {settings.kernel_backend!r}")
    return None


def _terminated(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Importing this module activated the package (``lmcache_platforms/__init__.py``), as any import of it does.
    SIGTERM ends a command as Ctrl-C does: the servers and engines it started are killed on the way out and its
    temporary folder is removed."""
    args = build_parser().parse_args(argv)
    if args.log_activation:
        logger.info("lmcache_platforms activated: %s", lmcache_platforms.activation.describe())
    if args.command not in UNCHECKED and (reason := refusal()):
        print(f"lmcache-platforms {args.command}: {reason}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"lmcache_platforms.cli.{args.command}")
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt as exc:
        name = str(exc) or "SIGINT"
        print(f"lmcache-platforms {args.command}: stopped by {name}", file=sys.stderr)
        return 128 + signal.Signals[name].value
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
