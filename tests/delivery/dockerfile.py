"""A small Dockerfile reader for the delivery tests: logical instructions, ARG defaults, COPY sources.

It follows the Dockerfile reference closely enough to catch what breaks a build before any layer runs:
unknown instructions, a first instruction other than ARG/FROM, malformed JSON (exec) forms, COPY/ADD
sources missing from the build context, and a FROM using a variable no ARG before the first FROM declares.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}
EXEC_FORM = {"CMD", "ENTRYPOINT", "SHELL", "RUN", "VOLUME"}
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


class DockerfileError(ValueError):
    """The Dockerfile would be rejected (or misbuilt) by docker build."""


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


def parse(path: Path) -> list[Instruction]:
    """Logical instructions of ``path`` (comments dropped, backslash continuations joined)."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        text = " ".join(part.strip() for part in pending).strip()
        pending = []
        keyword, _, args = text.partition(" ")
        if keyword.upper() not in INSTRUCTIONS:
            raise DockerfileError(f"{path.name}:{start}: unknown instruction {keyword!r}")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    if pending:
        raise DockerfileError(f"{path.name}:{start}: file ends inside a line continuation")
    return out


def _flags_and_rest(args: str) -> tuple[dict[str, str], list[str]]:
    if args.startswith("["):
        try:
            items = json.loads(args)
        except json.JSONDecodeError as exc:
            raise DockerfileError(f"malformed JSON form {args!r}: {exc}") from exc
        return {}, list(items)
    words = shlex.split(args)
    flags = {}
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        flags[name] = value
    return flags, words


def check(path: Path, context: Path) -> dict[str, str]:
    """Raise DockerfileError for anything docker build would reject; return the ARG defaults."""
    instructions = parse(path)
    if not instructions:
        raise DockerfileError(f"{path.name}: no instructions")
    first_real = next((i for i in instructions if i.keyword != "ARG"), None)
    if first_real is None or first_real.keyword != "FROM":
        raise DockerfileError(f"{path.name}: the first instruction after ARGs must be FROM")
    args: dict[str, str] = {}
    global_args: set[str] = set()
    seen_from = False
    for ins in instructions:
        where = f"{path.name}:{ins.line}"
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            if not seen_from:
                global_args.add(name)
            if default:
                args.setdefault(name, default)
        if ins.keyword == "FROM" or (ins.keyword == "ARG" and not seen_from):
            for name in _VARIABLE.findall(ins.args):
                if name not in global_args:
                    raise DockerfileError(f"{where}: ${name} is not an ARG declared before the first FROM")
        seen_from = seen_from or ins.keyword == "FROM"
        if ins.keyword in EXEC_FORM and ins.args.startswith("["):
            try:
                form = json.loads(ins.args)
            except json.JSONDecodeError as exc:
                raise DockerfileError(f"{where}: malformed exec form: {exc}") from exc
            if not all(isinstance(item, str) for item in form):
                raise DockerfileError(f"{where}: exec form must be a list of strings")
        if ins.keyword in ("COPY", "ADD"):
            flags, words = _flags_and_rest(ins.args)
            if len(words) < 2:
                raise DockerfileError(f"{where}: {ins.keyword} needs a source and a destination")
            if "from" not in flags:
                for source in words[:-1]:
                    if not list(context.glob(source.rstrip("/"))):
                        raise DockerfileError(f"{where}: {ins.keyword} source {source!r} is not in the context")
    return args


def referenced_repo_files(path: Path) -> list[str]:
    """Repository paths a RUN line executes from the copied tree (``docker/x.py``, ``scripts/y.sh``)."""
    found = []
    for ins in parse(path):
        if ins.keyword == "RUN":
            found += re.findall(r"(?<![\w/])((?:docker|scripts|csrc)/[\w./-]+)", ins.args)
    return found
