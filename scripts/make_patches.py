"""Writes patches/: the LMCache bug fixes of the patch catalog as unified diffs against the pinned LMCache source.

Run from the repository root: ``python -m scripts.make_patches`` (``--out DIR`` writes elsewhere). Each fix is code
of ours that the catalog installs at run time (a replacement function or class, or a wrapper of upstream's); here
it is moved into upstream's file under upstream's names, with the helpers and imports it needs, so that the patched
LMCache behaves as our runtime fix does without lmcache_platforms. The output depends only on our sources and the
pinned LMCache release (checked against its wheel's RECORD hashes first): re-running yields identical files.
"""

from __future__ import annotations

import argparse
import ast
import base64
import difflib
import hashlib
import importlib.metadata
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_platforms.patching.patch import Patch, split_ref
from lmcache_platforms.upstream_fixes.catalog import LMCACHE, PATCHES

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTION, PINNED = LMCACHE.split("==")
FIXES_PACKAGE = "lmcache_platforms.upstream_fixes."
OUR_TO_UPSTREAM_IMPORTS = {("lmcache_platforms.log", "init_logger"): ("lmcache.logging", "init_logger")}


@dataclass(frozen=True)
class PatchFile:
    """One patch: the catalog targets it carries and, for each wrapper among them, the private name upstream's
    own function keeps (the fixed one calls it where our wrapper calls ``upstream``)."""

    name: str
    title: str
    targets: tuple[str, ...]
    kept_as: dict[str, str] = field(default_factory=dict)


PATCH_FILES = (
    PatchFile("0001-offload-server-close", "the ZMQ offload server closes without aborting and answers every request",
              ("lmcache.v1.offload_server.zmq_server:ZMQOffloadServer",)),
    PatchFile("0002-pq-executor-shutdown-on-its-loop", "closing a remote backend no longer deadlocks its executor",
              ("lmcache.v1.storage_backend.job_executor.pq_executor:AsyncPQExecutor.shutdown",)),
    PatchFile("0003-disk-chunk-size-check", "a disk chunk file missing or cut short is a miss, never stale bytes",
              ("lmcache.v1.storage_backend.local_disk_backend:LocalDiskBackend.read_file",
               "lmcache.v1.storage_backend.local_disk_backend:LocalDiskBackend.load_bytes_from_disk"),
              {"lmcache.v1.storage_backend.local_disk_backend:LocalDiskBackend.read_file": "_read_file_unchecked"}),
    PatchFile("0004-redis-value-length", "a Redis value of the wrong length is a miss that keeps no buffer",
              ("lmcache.v1.storage_backend.connector.redis_connector:RedisConnector._get",
               "lmcache.v1.storage_backend.connector.redis_connector:RedisClusterConnector._get")),
    PatchFile("0005-redis-remove-sync", "the Redis connectors can remove a chunk",
              ("lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.remove_sync",),
              {"lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.remove_sync":
               "_remove_sync_unsupported"}),
    PatchFile("0006-batched-puts-tracked", "a batch of remote writes is tracked in put_tasks until it is done",
              ("lmcache.v1.storage_backend.remote_backend:RemoteBackend.batched_submit_put_task",),
              {"lmcache.v1.storage_backend.remote_backend:RemoteBackend.batched_submit_put_task":
               "_batched_submit_put_task_untracked"}),
    PatchFile("0007-dp-rank-device-table", "a data-parallel rank with its own device table gets that table's device",
              ("lmcache.integration.vllm.utils:_vllm_local_device_index",),
              {"lmcache.integration.vllm.utils:_vllm_local_device_index": "_vllm_dp_offset_device_index"}),
    PatchFile("0008-async-lookup-close", "closing the asynchronous lookup client and server wakes their threads first",
              tuple(f"lmcache.v1.lookup_client.lmcache_async_lookup_client:LMCacheAsyncLookup{side}.{method}"
                    for side in ("Client", "Server") for method in ("__init__", "close")),
              {f"lmcache.v1.lookup_client.lmcache_async_lookup_client:LMCacheAsyncLookup{side}.{method}": name
               for side in ("Client", "Server")
               for method, name in (("__init__", "_init_unrecorded"), ("close", "_close_unwoken"))}),
)

LEFT_OUT: tuple[tuple[tuple[str, ...], str], ...] = (
    (("lmcache.v1.storage_backend.remote_backend:RemoteBackend.close",),
     "its time limit is our setting `platforms.remote_close_timeout_s`, which LMCache's config has no key for"),
    (("lmcache.v1.storage_backend.remote_backend:RemoteBackend.contains",
      "lmcache.v1.storage_backend.remote_backend:RemoteBackend.batched_contains"),
     "its time budgets and back-off are three of our settings (`platforms.remote_lookup_timeout_s`, "
     "`platforms.remote_connect_timeout_s`, `platforms.remote_retry_s`) and it counts for our connector statistics"),
    (("lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.support_batched_get",
      "lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.batched_get",
      "lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.support_batched_contains",
      "lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.batched_contains",
      "lmcache.v1.storage_backend.connector.redis_connector:RedisConnector._batched_async_contains",
      "lmcache.v1.storage_backend.connector.redis_connector:RedisClusterConnector._batched_async_contains"),
     "batched Redis and fs:// reads and lookups are a speed-up more than a fix, and their Redis read goes through "
     "our own RESP reader (`upstream_fixes/redis_socket_reads.py`), a module of its own rather than a change"),
)


class NotExpressible(Exception):
    """A fix that cannot be moved into upstream's file as it is (a name clash, a dependency on our package)."""


def catalog_fixes() -> dict[str, Patch]:
    """The catalog's fixes of LMCache bugs: entries replaced from ``upstream_fixes`` and those a patch file names."""
    named = {target for patch_file in PATCH_FILES for target in patch_file.targets}
    return {p.target: p for p in PATCHES if p.replacement.startswith(FIXES_PACKAGE) or p.target in named}


def check_coverage() -> None:
    """Every catalog fix is either a patch file's or left out with a reason, and both name only catalog fixes."""
    fixes = catalog_fixes()
    placed = [t for patch_file in PATCH_FILES for t in patch_file.targets] + [t for ts, _ in LEFT_OUT for t in ts]
    unknown = sorted(set(placed) - set(fixes))
    twice = sorted({t for t in placed if placed.count(t) > 1})
    missing = sorted(set(fixes) - set(placed))
    if unknown or twice or missing:
        raise NotExpressible(f"patch files and catalog disagree: not catalog fixes {unknown}, placed twice {twice}, "
                             f"neither a patch nor left out {missing}")


def lmcache_root() -> Path:
    """The installed LMCache's site-packages folder, after checking every file of its package against RECORD."""
    distribution = importlib.metadata.distribution(DISTRIBUTION)
    if distribution.version != PINNED:
        raise NotExpressible(f"{DISTRIBUTION} {distribution.version} is installed; the patches are made against "
                             f"{PINNED}")
    for file in distribution.files or ():
        if file.hash is None or not str(file).startswith(f"{DISTRIBUTION}/"):
            continue
        digest = hashlib.new(file.hash.mode, file.locate().read_bytes()).digest()
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != file.hash.value:
            raise NotExpressible(f"{file} differs from the {DISTRIBUTION} {PINNED} wheel: reinstall it")
    return Path(distribution.locate_file(""))


class Module:
    """One Python source file: its text by lines, its tree and its top-level names."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text()
        self.lines = self.text.splitlines(keepends=True)
        self.tree = ast.parse(self.text)
        self.bindings: dict[str, ast.stmt] = {}
        for statement in self.tree.body:
            for name in bound_names(statement):
                self.bindings[name] = statement

    def first_line(self, node: ast.AST) -> int:
        """The 1-based first line of a definition, its decorators included."""
        decorators = getattr(node, "decorator_list", [])
        return min([node.lineno, *(d.lineno for d in decorators)])

    def segment(self, node: ast.AST) -> str:
        return "".join(self.lines[self.first_line(node) - 1:node.end_lineno])

    def definition(self, dotted: str) -> ast.AST:
        """The top-level definition ``name`` or the member ``Class.name``."""
        owner: list[ast.stmt] = self.tree.body
        node: ast.AST | None = None
        for part in dotted.split("."):
            node = next((n for n in owner if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                         and n.name == part), None)
            if node is None:
                raise NotExpressible(f"{self.path.name} has no {dotted}")
            owner = node.body
        assert node is not None
        return node


def bound_names(statement: ast.stmt) -> list[str]:
    """The top-level names a statement binds (imports, definitions, plain assignments)."""
    if isinstance(statement, ast.Import):
        return [alias.asname or alias.name.split(".")[0] for alias in statement.names]
    if isinstance(statement, ast.ImportFrom):
        return [alias.asname or alias.name for alias in statement.names]
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [statement.name]
    if isinstance(statement, ast.Assign | ast.AnnAssign):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return [t.id for t in targets if isinstance(t, ast.Name)]
    return []


def imported_as(statement: ast.stmt, name: str) -> tuple[str, str | None]:
    """What an import statement binds ``name`` to: (module, attribute) or (module, None) for a plain import."""
    if isinstance(statement, ast.Import):
        alias = next(a for a in statement.names if (a.asname or a.name.split(".")[0]) == name)
        return (alias.name, None) if alias.asname else (alias.name.split(".")[0], None)
    assert isinstance(statement, ast.ImportFrom) and statement.module is not None
    alias = next(a for a in statement.names if (a.asname or a.name) == name)
    return statement.module, alias.name


def import_line(name: str, source: tuple[str, str | None]) -> str:
    module, attr = source
    if attr is None:
        return f"import {module}" + (f" as {name}" if name != module else "")
    return f"from {module} import {attr}" + (f" as {name}" if name != attr else "")


def used_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def to_column(text: str, column: int) -> str:
    """``text`` (one definition) moved to start at ``column``."""
    return textwrap.indent(textwrap.dedent(text), " " * column)


def rename_def(text: str, old: str, new: str) -> str:
    """The definition ``text`` with its own name ``old`` changed to ``new``."""
    renamed, count = re.subn(rf"^(\s*(?:async\s+)?def\s+){re.escape(old)}\(", rf"\g<1>{new}(", text, count=1,
                             flags=re.MULTILINE)
    if count != 1:
        raise NotExpressible(f"no definition of {old} to rename")
    return renamed


def replace_spans(module: Module, node: ast.AST, spans: list[tuple[ast.AST, str]]) -> str:
    """``node``'s source with each span's node replaced by its text (positions are UTF-8 columns)."""
    start = module.first_line(node)
    raw = "".join(module.lines[start - 1:node.end_lineno]).encode()
    offsets = [0]
    for line in module.lines[start - 1:node.end_lineno]:
        offsets.append(offsets[-1] + len(line.encode()))

    def at(line: int, column: int) -> int:
        return offsets[line - start] + column

    for span, text in sorted(spans, key=lambda s: (s[0].lineno, s[0].col_offset), reverse=True):
        begin, end = at(span.lineno, span.col_offset), at(span.end_lineno, span.end_col_offset)
        raw = raw[:begin] + text.encode() + raw[end:]
    return raw.decode()


def upstream_doc_names(text: str, renames: dict[str, str]) -> str:
    """Docstrings of replacements name their upstream target first ("Replacement for ``X``: ..."): upstream that
    is the function itself. Our names in double backquotes become the upstream names they replace."""
    text = re.sub(r'("""|\')Replacement for ``[^`]+``(?: \([^)]*\))?[:,]? *(\w)',
                  lambda m: m[1] + m[2].upper(), text)
    for ours, theirs in renames.items():
        text = text.replace(f"``{ours}``", f"``{theirs}``")
    return text


@dataclass
class Edit:
    """Lines ``start`` to ``end`` (1-based, inclusive; ``end = start - 1`` inserts) of an upstream file become
    ``text``."""

    start: int
    end: int
    text: str


@dataclass
class FilePlan:
    """What one upstream file receives: edits in place, helper definitions and imports."""

    module: Module
    edits: list[Edit] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    helpers: dict[str, tuple[Module, ast.stmt]] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)


class Transplant:
    """Moves our fixes into upstream's files: one instance per patch file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.plans: dict[str, FilePlan] = {}
        self.ours: dict[str, Module] = {}
        self.renames: dict[str, str] = {}

    def plan(self, module_name: str) -> FilePlan:
        if module_name not in self.plans:
            path = self.root / (module_name.replace(".", "/") + ".py")
            self.plans[module_name] = FilePlan(Module(path))
        return self.plans[module_name]

    def our_module(self, module_name: str) -> Module:
        if module_name not in self.ours:
            self.ours[module_name] = Module(REPO / (module_name.replace(".", "/") + ".py"))
        return self.ours[module_name]

    def add(self, patch: Patch, kept_as: str | None) -> None:
        target_module, attr = split_ref(patch.target)
        our_module_name, our_name = split_ref(patch.replacement)
        ours, plan = self.our_module(our_module_name), self.plan(target_module)
        upstream_node = plan.module.definition(attr)
        our_node = ours.definition(our_name)
        column = upstream_node.col_offset
        short = attr.split(".")[-1]
        self.renames[our_name] = attr
        plan.anchors.append(plan.module.first_line(plan.module.definition(attr.split(".")[0])))
        if isinstance(our_node, ast.ClassDef):
            self.merge_class(plan, ours, our_node, upstream_node)
            return
        if patch.wrapper:
            if kept_as is None:
                raise NotExpressible(f"{patch.target} is a wrapper: its patch file must name what upstream's keeps")
            inner = wrapped_function(our_node)
            text = to_column(self.called_kept(ours, our_node, inner, kept_as, column > 0), column)
            text = rename_def(text, inner.name, short)
            kept = rename_def(plan.module.segment(upstream_node), short, kept_as)
            separator = "\n" if column else "\n\n"
            text = text + separator + kept
            self.needs(plan, ours, inner, skip={our_name})
        else:
            text = rename_def(to_column(replace_spans(ours, our_node, plain_self(our_node)), column), our_name, short)
            self.needs(plan, ours, our_node, skip={our_name})
        plan.edits.append(Edit(plan.module.first_line(upstream_node), upstream_node.end_lineno, text))

    def called_kept(self, ours: Module, outer: ast.AST, inner: ast.AST, kept_as: str, method: bool) -> str:
        """The wrapper's inner function with each call of the wrapped original made to upstream's kept one."""
        original = outer.args.args[0].arg
        spans = []
        for call in ast.walk(inner):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == original):
                continue
            arguments = [*call.args, *call.keywords]
            callee = kept_as
            if method:
                if not (call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == "self"):
                    raise NotExpressible(f"{original}(...) in {inner.name} is not called with self first")
                arguments, callee = arguments[1:], f"self.{kept_as}"
            rendered = ", ".join(ast.get_source_segment(ours.text, a) or "" for a in arguments)
            spans.append((call, f"{callee}({rendered})"))
        if not spans:
            raise NotExpressible(f"{inner.name} never calls upstream's original")
        return replace_spans(ours, inner, spans + (plain_self(inner) if method else []))

    def merge_class(self, plan: FilePlan, ours: Module, our_class: ast.ClassDef, upstream_class: ast.AST) -> None:
        """Our subclass's methods into upstream's class: those of the same name replace upstream's, new ones follow
        the method before them in our class (at the top of upstream's body for a first one)."""
        upstream_methods = {n.name: n for n in upstream_class.body
                            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        body = upstream_class.body
        anchor_end = plan.module.first_line(body[0]) - 1
        pending: list[str] = []
        column = body[0].col_offset

        def flush() -> None:
            if pending:
                plan.edits.append(Edit(anchor_end + 1, anchor_end, "\n" + "\n".join(pending)))
                pending.clear()

        for node in our_class.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            text = to_column(replace_spans(ours, node, plain_self(node)), column)
            self.needs(plan, ours, node, skip={our_class.name})
            if node.name in upstream_methods:
                flush()
                upstream = upstream_methods[node.name]
                plan.edits.append(Edit(plan.module.first_line(upstream), upstream.end_lineno, text))
                anchor_end = upstream.end_lineno
            else:
                pending.append(text)
        flush()

    def needs(self, plan: FilePlan, ours: Module, node: ast.AST, skip: set[str]) -> None:
        """Bring along what ``node`` uses from our module: imports (ours mapped to upstream's) and helper
        definitions, transitively."""
        work, seen = [node], set(skip)
        while work:
            for name in sorted(used_names(work.pop()) - seen):
                seen.add(name)
                statement = ours.bindings.get(name)
                if statement is None:
                    continue
                if isinstance(statement, ast.Import | ast.ImportFrom):
                    self.needs_import(plan, name, imported_as(statement, name))
                else:
                    self.needs_helper(plan, ours, name, statement)
                    work.append(statement)

    def needs_import(self, plan: FilePlan, name: str, source: tuple[str, str | None]) -> None:
        source = OUR_TO_UPSTREAM_IMPORTS.get(source, source)
        if source[0].split(".")[0] == "lmcache_platforms":
            raise NotExpressible(f"uses {name} from {source[0]}")
        theirs = plan.module.bindings.get(name)
        if theirs is None:
            plan.imports[name] = source
        elif not isinstance(theirs, ast.Import | ast.ImportFrom) or imported_as(theirs, name) != source:
            raise NotExpressible(f"{plan.module.path.name} binds {name} otherwise than our {import_line(name, source)}")

    def needs_helper(self, plan: FilePlan, ours: Module, name: str, statement: ast.stmt) -> None:
        theirs = plan.module.bindings.get(name)
        if theirs is None:
            plan.helpers[name] = (ours, statement)
        elif plan.module.segment(theirs) != ours.segment(statement):
            raise NotExpressible(f"{plan.module.path.name} already defines {name}")

    def render(self) -> dict[str, tuple[str, str]]:
        """Per upstream file (relative path): its text before and after."""
        rendered = {}
        for plan in self.plans.values():
            module = plan.module
            edits = list(plan.edits)
            if plan.helpers:
                at = self.above_comments(module, min(plan.anchors))
                helpers = sorted(plan.helpers.values(), key=lambda found: (str(found[0].path), found[1].lineno))
                edits.append(Edit(at, at - 1, "".join(ours.segment(h) + "\n\n" for ours, h in helpers)))
            after = import_lines(module)
            for section in range(3):
                lines = sorted(import_line(n, s) for n, s in plan.imports.items() if import_section(s[0]) == section)
                if lines:
                    at = after[section] + 1
                    edits.append(Edit(at, at - 1, "".join(line + "\n" for line in lines)))
            lines = list(module.lines)
            for edit in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
                text = upstream_doc_names(edit.text, self.renames)
                lines[edit.start - 1:edit.end] = text.splitlines(keepends=True)
            relative = module.path.relative_to(self.root).as_posix()
            rendered[relative] = (module.text, "".join(lines))
        return rendered

    @staticmethod
    def above_comments(module: Module, line: int) -> int:
        """``line``, moved up past the comment lines directly above it."""
        while line > 1 and module.lines[line - 2].lstrip().startswith("#"):
            line -= 1
        return line


def plain_self(function: ast.AST) -> list[tuple[ast.AST, str]]:
    """The span making a method's annotated ``self`` plain, as upstream writes it (none when it is already)."""
    arguments = function.args.args
    if arguments and arguments[0].arg == "self" and arguments[0].annotation is not None:
        return [(arguments[0], "self")]
    return []


def wrapped_function(outer: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function a catalog wrapper returns (``def wrap_x(upstream): def x(...): ...; return x``)."""
    returned = next(n for n in outer.body if isinstance(n, ast.Return))
    return next(n for n in outer.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and isinstance(returned.value, ast.Name)
                and n.name == returned.value.id)


def import_section(module: str) -> int:
    """LMCache's import sections, in order: the standard library, third parties, LMCache itself."""
    top = module.split(".")[0]
    return 0 if top in sys.stdlib_module_names else 2 if top == "lmcache" else 1


def import_lines(module: Module) -> dict[int, int]:
    """Per import section, the last line of the module's leading imports in it (sections it lacks fall back to
    the one before, or the first import)."""
    last: dict[int, int] = {}
    first = 0
    for statement in module.tree.body:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            name = statement.names[0].name if isinstance(statement, ast.Import) else statement.module or ""
            last[import_section(name)] = statement.end_lineno or 0
            first = first or statement.lineno - 1
        elif not isinstance(statement, ast.Expr | ast.If | ast.Try):
            break
    for section in range(3):
        last.setdefault(section, last.get(section - 1, first))
    return last


def header(patch_file: PatchFile, fixes: dict[str, Patch]) -> str:
    """The patch's description, above its diff (``patch`` and ``git apply`` skip it)."""
    sources = sorted({split_ref(fixes[t].replacement)[0] for t in patch_file.targets})
    lines = [f"Subject: {patch_file.title}", ""]
    for target in patch_file.targets:
        why = fixes[target].why
        lines += [*textwrap.wrap(f"{target}: {why}", 100), ""]
    lines += [f"Against {DISTRIBUTION} {PINNED}. Generated by scripts/make_patches.py from "
              + ", ".join(f"{s.replace('.', '/')}.py" for s in sources) + "; do not edit.", ""]
    return "".join(line + "\n" for line in lines)


def diff(relative: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        f"a/{relative}", f"b/{relative}", n=3))


def render() -> dict[str, str]:
    """Every file of patches/: name -> text."""
    check_coverage()
    root, fixes = lmcache_root(), catalog_fixes()
    files: dict[str, str] = {}
    touched: dict[str, str] = {}
    for patch_file in PATCH_FILES:
        transplant = Transplant(root)
        for target in patch_file.targets:
            transplant.add(fixes[target], patch_file.kept_as.get(target))
        body = ""
        for relative, (before, after) in sorted(transplant.render().items()):
            if relative in touched:
                raise NotExpressible(f"{patch_file.name} and {touched[relative]} both change {relative}")
            touched[relative] = patch_file.name
            body += diff(relative, before, after)
        files[f"{patch_file.name}.patch"] = header(patch_file, fixes) + body
    files["README.md"] = readme(fixes)
    return files


def readme(fixes: dict[str, Patch]) -> str:
    lines = [
        "# LMCache bug fixes as patches",
        "",
        f"The fixes of LMCache {PINNED} bugs that `lmcache_platforms` installs at run time (the patch catalog,",
        "`lmcache_platforms/upstream_fixes/catalog.py`), as patches against that release's source, for image "
        "builders",
        "who bake them into LMCache and for LMCache's maintainers. Generated by `python -m scripts.make_patches` "
        "from",
        "our fix code; do not edit (`tests/upstream_fixes/test_patch_files.py` checks that they are its output, "
        "that",
        "each applies to the pinned release, and that the fixes' tests pass on the patched copy without our "
        "package).",
        "",
        "| patch | fixes | catalog targets |",
        "| --- | --- | --- |",
    ]
    for patch_file in PATCH_FILES:
        targets = ", ".join(f"`{t}`" for t in patch_file.targets)
        lines.append(f"| `{patch_file.name}.patch` | {patch_file.title} | {targets} |")
    lines += [
        "",
        "Each patch's header says why, in the catalog's words. To apply them to an installed LMCache:",
        "",
        "```bash",
        "for p in patches/*.patch; do patch -p1 -d \"$(python -c 'import lmcache, pathlib; "
        "print(pathlib.Path(lmcache.__file__).parents[1])')\" -i \"$PWD/$p\"; done",
        "```",
        "",
        "or `git apply patches/*.patch` at the root of a tree holding `lmcache/` (LMCache's repository at the "
        "release).",
        "",
        "`lmcache_platforms` installs its own fixes at run time whether or not these are applied, wrapping the "
        "patched",
        "functions; where both check the same thing, ours accepts the patched code's outcome (a disk read's "
        "error is a miss).",
        "",
        "## Left out",
        "",
    ]
    for targets, reason in LEFT_OUT:
        names = ", ".join(f"`{split_ref(t)[1]}`" for t in targets)
        lines.append(f"- {names}: {reason}.")
    return "".join(line + "\n" for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "patches", help="folder to write (default: patches/)")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    files = render()
    for stale in sorted(set(p.name for p in out.iterdir()) - set(files)):
        (out / stale).unlink()
    for name, text in files.items():
        (out / name).write_text(text)
    print(f"wrote {len(files)} files to {out}")


if __name__ == "__main__":
    main()
