"""The import rules of the layout by role (docs/design.md, "Layout"), checked over the source.

Every module of nfproxy/ and bench/ is parsed with `ast` (nothing is imported, so a module that
needs root or a missing library is still checked); every `import` and `from ... import`,
including those inside functions and relative ones, counts. A layer is the first package under
nfproxy (nfproxy.kernel.conntrack is in `kernel`); top-level modules (nfproxy.testing) and
bench/ are bound only by the rule that nothing outside tests/ imports tests.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Rule:
    """What one layer may not import: `never` lists layers; `only`, when set, is all it may."""

    layer: str
    never: frozenset[str] = frozenset()
    only: frozenset[str] | None = None
    why: str = ""

    def forbids(self, target_layer: str) -> bool:
        if target_layer == self.layer:
            return False
        if self.only is not None:
            return target_layer not in self.only
        return target_layer in self.never


LAYERS = frozenset(
    {"core", "sources", "nftables", "backends", "kernel", "daemon", "analysis", "verify", "cli"}
)

RULES = (
    Rule("core", only=frozenset(), why="the functional core imports nothing else of nfproxy"),
    Rule("nftables", only=frozenset({"core"}), why="typed nft objects are a library over core"),
    Rule("sources", never=frozenset({"cli"}), why="sources know no flags"),
    Rule(
        "backends", never=frozenset({"kernel", "daemon", "sources"}),
        why="backends are pure renderers of the model",
    ),
    Rule(
        "kernel", never=frozenset({"daemon", "sources", "backends"}),
        why="the kernel layer applies what it is given and holds no policy",
    ),
    Rule("analysis", never=frozenset({"backends"}), why="analysis reads rules back, never renders"),
    Rule("daemon", never=frozenset({"cli"}), why="the daemon is driven by the cli, never the reverse"),
)

# Known violations, each waiting for the change that fixes it (none now);
# test_allowed_violations_still_exist fails once an entry is stale.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True, slots=True)
class Import:
    module: str
    target: str
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(module: str, source: str, is_package: bool = False) -> Iterator[Import]:
    """Every module `source` imports, absolute; `from a import b` yields a.b (b may be a module)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(package, node)
            for alias in node.names:
                target = base if alias.name == "*" else f"{base}.{alias.name}"
                yield Import(module, target, node.lineno)


def _from_base(package: list[str], node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    up = package[: len(package) - (node.level - 1)]
    return ".".join([*up, *([node.module] if node.module else [])])


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "nfproxy" and len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return None


def violations(found: Iterator[Import]) -> Iterator[tuple[Import, str]]:
    rules = {r.layer: r for r in RULES}
    for imp in found:
        top = imp.target.split(".")[0]
        if top == "tests":
            yield imp, "nothing in nfproxy/ or bench/ imports tests"
            continue
        if top != "nfproxy":
            continue
        here, there = layer(imp.module), layer(imp.target)
        rule = rules.get(here) if here else None
        if rule is not None and rule.forbids(there or "nfproxy"):
            yield imp, f"{rule.layer} -> {there or imp.target}: {rule.why}"


def source_files() -> list[Path]:
    return sorted([*(ROOT / "nfproxy").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])


@functools.cache
def tree_imports() -> list[Import]:
    return [
        imp
        for path in source_files()
        for imp in imports(module_name(path), path.read_text(), path.name == "__init__.py")
    ]


def test_every_layer_is_a_package_or_planned() -> None:
    """A rule about a layer that was renamed away would hold vacuously: catch the rename."""
    present = {p.name for p in (ROOT / "nfproxy").iterdir() if (p / "__init__.py").exists()}
    planned = {"nftables"}  # helper A's typed nft objects (issue G point 1), in progress
    assert present - LAYERS == set(), "a new package needs a line in LAYERS (and maybe a rule)"
    assert LAYERS - present <= planned


def test_import_rules_hold() -> None:
    found = tree_imports()
    assert len({imp.module for imp in found}) > 50, "the scan found too few modules"
    broken = [
        f"{imp.module} (line {imp.line}) imports {imp.target}: {why}"
        for imp, why in violations(iter(found))
        if (imp.module, _module_of(imp.target)) not in ALLOWED
    ]
    assert broken == []


def test_allowed_violations_still_exist() -> None:
    """An allow-list entry whose import is gone must be removed, or it would hide a new one."""
    live = {(imp.module, _module_of(imp.target)) for imp, _ in violations(iter(tree_imports()))}
    assert ALLOWED <= live, f"stale entries in ALLOWED: {sorted(ALLOWED - live)}"


@functools.cache
def _modules() -> frozenset[str]:
    return frozenset(module_name(path) for path in source_files())


def _module_of(target: str) -> str:
    """`nfproxy.cli.config.Config` -> `nfproxy.cli.config` (the module holding the name)."""
    modules = _modules()
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("nfproxy.kernel.conntrack", "from nfproxy.daemon.conntrack import FlowFilter", 1),
        ("nfproxy.kernel.conntrack", "from ..daemon import conntrack", 1),
        ("nfproxy.kernel.conntrack", "from . import netns", 0),
        ("nfproxy.core.model", "import nfproxy.sources.manifests", 1),
        ("nfproxy.core.model", "from .categorize import Routing", 0),
        ("nfproxy.nftables.objects", "from nfproxy.core.model import IPFamily", 0),
        ("nfproxy.nftables.objects", "from nfproxy.kernel import nft", 1),
        ("nfproxy.analysis.check", "def f():\n    from nfproxy.backends.nft import render", 1),
        ("nfproxy.backends.nft.render", "from nfproxy.kernel.process import KernelError", 1),
        ("nfproxy.sources.kube", "from nfproxy.cli import config", 1),
        ("nfproxy.daemon.server", "from nfproxy.cli.config import FlagError", 1),
        ("nfproxy.daemon.server", "from nfproxy.core.flags import FlagError", 0),
        ("nfproxy.verify.lab", "from nfproxy.daemon import proxier", 0),
        ("nfproxy.verify.lab", "from tests import scenarios", 1),
        ("bench.sync", "import tests.scenarios", 1),
        ("nfproxy.testing", "from nfproxy.kernel import netns", 0),
    ],
)
def test_the_checker_sees_a_violation(module: str, source: str, expected: int) -> None:
    """The checker itself: a rule it cannot see broken would pass on any tree."""
    assert len(list(violations(imports(module, source)))) == expected


# --------------------------------------------------------------------------------------------
# Modules, not only layers (issue Q, point 4): no private name taken across modules, no import
# cycle between modules, no private name of pyroute2's. Each allow-list names today's debt and
# is emptied by the change that pays it; test_allow_lists_are_not_stale keeps them honest.

ALLOWED_PRIVATE: frozenset[tuple[str, str]] = frozenset()
ALLOWED_CYCLES: frozenset[frozenset[str]] = frozenset()
ALLOWED_PYROUTE2: frozenset[tuple[str, str]] = frozenset({
    ("nfproxy.kernel.nfnetlink.messages", "_nlmsg_base__compiled_nla"),
})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _bound_modules(module: str, tree: ast.AST, is_package: bool) -> dict[str, str]:
    """Local name -> what it names, for every name an import binds to nfproxy or pyroute2."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:  # `import a.b` binds `a`
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(package, node)
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return {k: v for k, v in bound.items() if v.split(".")[0] in ("nfproxy", "pyroute2")}


def private_references(module: str, source: str, is_package: bool = False) -> Iterator[str]:
    """Private names this module takes from another nfproxy or pyroute2 module: imported
    (`from m import _x`) or reached through an imported name (`m._x`), as `m._x`; and pyroute2's
    name-mangled privates (`_nlmsg_base__compiled_nla`) wherever they are spelled."""
    tree = ast.parse(source)
    bound = _bound_modules(module, tree, is_package)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                target = bound.get(alias.asname or alias.name, "")
                owner = target.rpartition(".")[0]
                if _is_private(alias.name) and target and owner != module:
                    yield target
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if _is_private(node.attr) and node.value.id in bound:
                yield f"{bound[node.value.id]}.{node.attr}"
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name.startswith("_nlmsg") or name.startswith("_nlsocket"):
                yield name


def defined_names(source: str) -> set[str]:
    """Every name a module defines: functions, classes, assigned names and attributes."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


def foreign_private_attributes(source: str, ours: set[str]) -> Iterator[str]:
    """In a module that imports pyroute2: `x._name` where `_name` is nothing nfproxy defines,
    so it can only be a library's private (pyroute2's sockets and messages are the objects
    such a module holds)."""
    tree = ast.parse(source)
    if not any(imp.target.startswith("pyroute2") for imp in imports("m", source)):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in ours:
            yield node.attr


def module_graph(found: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in _modules() if m.startswith("nfproxy")}
    for imp in found:
        if imp.module in graph and imp.target.startswith("nfproxy."):
            target = _module_of(imp.target)
            if target in graph and target != imp.module:
                graph[imp.module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


@functools.cache
def _private_by_module() -> frozenset[tuple[str, str]]:
    ours = [path for path in source_files() if module_name(path).startswith("nfproxy")]
    defined = set().union(*(defined_names(path.read_text()) for path in ours))
    return frozenset({
        *((module_name(path), ref)
          for path in ours
          for ref in private_references(module_name(path), path.read_text(), path.name == "__init__.py")),
        *((module_name(path), f"pyroute2 .{name}")
          for path in ours
          for name in foreign_private_attributes(path.read_text(), defined)),
    })


def _split_private(refs: frozenset[tuple[str, str]]) -> tuple[frozenset[tuple[str, str]], frozenset[tuple[str, str]]]:
    pyroute2 = frozenset((m, r) for m, r in refs if r.startswith(("pyroute2", "_nl")))  # "pyroute2 .x": an attribute
    return refs - pyroute2, pyroute2


def test_no_private_name_crosses_modules() -> None:
    ours, _ = _split_private(_private_by_module())
    assert sorted(ours - ALLOWED_PRIVATE) == []


def test_no_pyroute2_private_name() -> None:
    _, theirs = _split_private(_private_by_module())
    assert sorted(theirs - ALLOWED_PYROUTE2) == []


def test_no_import_cycle_between_modules() -> None:
    found = cycles(module_graph(tree_imports()))
    assert sorted(map(sorted, found - ALLOWED_CYCLES)) == []


def test_allow_lists_are_not_stale() -> None:
    ours, theirs = _split_private(_private_by_module())
    assert ALLOWED_PRIVATE <= ours, f"stale: {sorted(ALLOWED_PRIVATE - ours)}"
    assert ALLOWED_PYROUTE2 <= theirs, f"stale: {sorted(ALLOWED_PYROUTE2 - theirs)}"
    live = cycles(module_graph(tree_imports()))
    assert ALLOWED_CYCLES <= live, f"stale: {sorted(map(sorted, ALLOWED_CYCLES - live))}"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("nfproxy.kernel.a", "from nfproxy.kernel.b import _x", ["nfproxy.kernel.b._x"]),
        ("nfproxy.kernel.a", "from .b import _x as y", ["nfproxy.kernel.b._x"]),
        ("nfproxy.kernel.a", "from nfproxy.kernel import b\nb._x()", ["nfproxy.kernel.b._x"]),
        ("nfproxy.kernel.a", "import nfproxy.kernel.b as b\nb._y", ["nfproxy.kernel.b._y"]),
        ("nfproxy.kernel.a", "from nfproxy.kernel.b import x, __all__\nx.y", []),
        ("nfproxy.kernel.a", "def _x(): pass\n_x()\nself._y", []),
        ("nfproxy.kernel.a", "from pyroute2.netlink import _private", ["pyroute2.netlink._private"]),
        ("nfproxy.kernel.a", "class M:\n    _nlmsg_base__compiled_nla = False", ["_nlmsg_base__compiled_nla"]),
    ],
)
def test_the_checker_sees_a_private_reference(module: str, source: str, expected: list[str]) -> None:
    assert sorted(private_references(module, source)) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from pyroute2 import IPRoute\nsock = IPRoute()\nsock._run_with_cleanup(f)", ["_run_with_cleanup"]),
        ("from pyroute2 import IPRoute\ndef _mine(): pass\nx._mine()\nself._y = 1\nself._y", []),
        ("import json\nsock._run_with_cleanup(f)", []),  # no pyroute2 here: not judged
    ],
)
def test_the_checker_sees_a_pyroute2_private_attribute(source: str, expected: list[str]) -> None:
    assert list(foreign_private_attributes(source, defined_names(source))) == expected


def test_the_checker_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": {"g"}, "g": {"f"}}
    assert cycles(graph) == {frozenset("abc"), frozenset("fg")}
