"""The layers point one way: ``radixd.core`` imports nothing of the plugins, grammars or
server (they are wired to it from outside), and no module of ``radixd`` takes part in an
import cycle (module-level and function-level imports alike)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "radixd"
OUTSIDE_CORE = ("radixd.plugins", "radixd.grammars", "radixd.server")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_core_imports_no_plugins_grammars_or_server():
    core = sorted(m for m in all_modules() if m == "radixd.core" or m.startswith("radixd.core."))
    code = ("import importlib, json, sys\n"
            f"for m in {core!r}:\n"
            "    importlib.import_module(m)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({OUTSIDE_CORE!r}))))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(core) > 20  # the walk found the package
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The radixd modules ``name`` imports anywhere in its body (not under ``if
    TYPE_CHECKING:``); ``from radixd.x import y`` is module ``radixd.x.y`` when that is one."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            for alias in node.names:
                found.add(f"{target}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return None


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_radixd():
    modules = all_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["radixd"] >= {"radixd.plugins.wiring", "radixd.core.config"}  # lazy imports count
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_names_no_plugins_grammars_or_server_anywhere():
    """Not even inside a function (the import-time test above cannot see those)."""
    modules = all_modules()
    core = {m: p for m, p in modules.items() if m == "radixd.core" or m.startswith("radixd.core.")}
    wrong = {m: sorted(i for i in imports_of(m, p, modules) if i.startswith(OUTSIDE_CORE))
             for m, p in core.items()}
    assert {m: found for m, found in wrong.items() if found} == {}
