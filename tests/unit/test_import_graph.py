"""The package's import graph has no cycle: a module that needs another's
helper gets it from where it lives, never by importing inside a function to
dodge a cycle. Read with `ast`, so nothing is imported or built."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dsecd"


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _run_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`, which never
    runs: a type hint's import (a Sandbox naming its Client, the Client
    making Sandboxes) is no import of the running code."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its body (a
    function-level import counts: it is the usual way to hide a cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _run_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                # `from . import x` imports the module x; `from .m import f` imports m.
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "dsecd.node" in graph and graph["dsecd.node"], "the graph was not read"
    assert cycles(graph) == []


def test_an_import_for_type_hints_only_is_not_counted_and_one_that_runs_is():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    names = {a.name for n in _run_nodes(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"b", "c"}


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists its packages by hand: a new one left out works in
    the editable install and is missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found == listed


def test_the_distribution_says_its_annotations_are_for_type_checkers():
    """Without a py.typed marker (PEP 561) in the wheel, mypy and pyright
    take an installed dsecd as untyped: an import-untyped error, and every
    SDK name (Client, Sandbox, ExecResult) Any in a trainer's code."""
    import tomllib

    data = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["dsecd"]
    assert (PACKAGE / "py.typed").is_file()


def test_modules_use_only_what_native_exports():
    """native.py is the C layer's one face: others use the names in its
    __all__ and none of its private ones (read with ast: the module needs
    the built extension to import)."""
    tree = ast.parse((PACKAGE / "native.py").read_text())
    exported: set[str] = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__":
            exported |= {e.value for e in node.value.elts}
    used: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "native.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "native":
                used.setdefault(node.attr, set()).add(path.name)
    private = {name: files for name, files in used.items() if name.startswith("_")}
    assert not private, f"private names of native.py used elsewhere: {private}"
    missing = {name: files for name, files in used.items() if name not in exported}
    assert not missing, f"used but not in native.__all__: {missing}"
