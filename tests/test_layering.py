"""The dependency direction of STYLE.md, checked on the source's imports.

Every import of a tigon module counts, wherever it sits: at the top of a file, inside a function, or
under ``TYPE_CHECKING`` (a type-only import still says which module knows which). The files are parsed,
not imported, so this runs in a moment and needs neither torch nor Triton.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src"


def _module_files() -> dict[str, Path]:
    """Each module under ``src/tigon`` by its dotted name (a package by its ``__init__.py``)."""
    files = {}
    for path in sorted((SOURCE / "tigon").rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


FILES = _module_files()


def _is_package(module: str) -> bool:
    return FILES[module].name == "__init__.py"


def package_of(module: str) -> str:
    """The package whose directory holds ``module``'s file: a package's ``__init__`` is its own."""
    return module if _is_package(module) else module.rpartition(".")[0]


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The tigon modules one import statement of ``module`` names.

    ``from p import name`` names the submodule ``p.name`` where there is one, else the module ``p``
    (which defines ``name``); ``import p.q`` names ``p.q``.
    """
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in FILES}
    if node.level:
        base = package_of(module).split(".")
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = set()
    for alias in node.names:
        if f"{source}.{alias.name}" in FILES:
            targets.add(f"{source}.{alias.name}")
        elif source in FILES:
            targets.add(source)
    return targets


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in FILES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(module, node)
        graph[module] = edges - {module}
    return graph


GRAPH = _graph()


def _cycles(nodes: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module among ``nodes`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(GRAPH[node] & nodes):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return components


def test_the_graph_sees_the_imports_it_should():
    # Guards the parser: a package import, a relative import and a function-level one.
    assert "tigon.functional" in GRAPH["tigon.nn"]
    assert "tigon.transformers.patching" in GRAPH["tigon.transformers"]
    assert "tigon.ops.fused_linear" in GRAPH["tigon.ops.vocab_parallel"]
    assert "tigon.ops.fp8" in GRAPH["tigon.transformers.causal_lm"]


@pytest.mark.parametrize("package", sorted({package_of(module) for module in FILES}))
def test_no_import_cycles_inside_a_package(package):
    members = {module for module in FILES if package_of(module) == package}
    cycles = _cycles(members)
    assert not cycles, f"import cycles in {package}: " + "; ".join(" <-> ".join(cycle) for cycle in cycles)


def _in(module: str, *packages: str) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def _violations(importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _in(module, *importers)
        for target in targets
        if _in(target, *forbidden)
    )


def test_ops_know_nothing_above_them():
    assert not _violations(
        ("tigon.ops",), ("tigon.nn", "tigon.functional", "tigon.transformers", "tigon.losses")
    )


def test_functional_and_nn_never_import_transformers():
    assert not _violations(("tigon.functional", "tigon.nn"), ("tigon.transformers",))


def test_the_patcher_sits_on_top_of_transformers():
    """Only the package's ``__init__`` imports the patcher, and no module of the package imports the
    ``__init__``: the layer modules the patcher installs, and what they share, sit below it."""
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if package_of(module) == "tigon.transformers" and module != "tigon.transformers"
        for target in targets
        if target in ("tigon.transformers", "tigon.transformers.patching")
    )
    assert not wrong
