"""The code's layers hold: no import circle among the modules of `app/` or of `engine/`.

Every import counts, as the source spells it: at the top of a module, inside a function,
and under `if TYPE_CHECKING:` (a circle made of type hints is still a circle in the design,
and one run-time import away from a real one). Read from the source (ast), nothing is
imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str, root: Path) -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports, wherever in it the import is."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, `level - 1` up
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            # `from pkg import name`: the submodule `pkg.name` where there is one, else `pkg`
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c`: the deepest one known
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(package, root)
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def test_the_graph_sees_every_kind_of_import(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n"
    )
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "c.py").write_text("from pkg import a\nfrom ..b import f\n")
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.b"}
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


@pytest.mark.parametrize("package", ["app", "engine"])
def test_no_import_circle(package: str) -> None:
    found = circles(import_graph(package))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_app_files_and_classes_stay_readable() -> None:
    """No file of `app/` over 500 lines, no class over 400."""
    long = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 500:
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                long.append(f"{path.relative_to(ROOT)}: class {node.name}")
    assert not long, long
