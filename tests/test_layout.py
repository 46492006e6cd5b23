"""The import rules of the layout by role (docs/design.md, "Layout"), checked over the source.

Every module of nfproxy/ and bench/ is parsed with `ast` (nothing is imported, so a module that
needs root or a missing library is still checked); every `import` and `from ... import`,
including those inside functions and relative ones, counts. A layer is the first package under
nfproxy (nfproxy.kernel.conntrack is in `kernel`); top-level modules (nfproxy.testing) and
bench/ are bound only by the rule that nothing outside tests/ imports tests.
"""

from __future__ import annotations

import ast
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
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:
                target = base if alias.name == "*" else f"{base}.{alias.name}"
                yield Import(module, target, node.lineno)


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


def _module_of(target: str) -> str:
    """`nfproxy.cli.config.Config` -> `nfproxy.cli.config` (the module holding the name)."""
    modules = {module_name(path) for path in source_files()}
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
