"""The package's layout: imports run one way (no cycle), and only ``zephon_compat`` touches Zephon's private names.

Both read the package's source with ``ast`` (nothing is imported but Zephon,
to list its private attribute names), so they hold for every module,
including the optional integrations whose dependencies are not installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zephon_loader

PACKAGE = Path(zephon_loader.__file__).resolve().parent
COMPAT = "zephon_loader.zephon_compat"


def _modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports, at module level or inside functions (a lazy import is still an arrow).

    ``import zephon_loader`` alone is no arrow: the package root imports its public names lazily (PEP 562).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != "zephon_loader" and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_package_has_no_import_cycle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert sum(map(len, graph.values())) > 50, "the import walk found too few arrows: it is broken"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_and_contract_import_no_torch():
    """The configuration is read and checked before anything heavy loads."""
    light = {name for name in MODULES if name.startswith("zephon_loader.config") or name == "zephon_loader.contract"}
    for name in sorted(light):
        tree = ast.parse(MODULES[name].read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "torch" not in imported, name
        for dependency in _imports(name, MODULES[name]):
            assert dependency.startswith("zephon_loader.config") or dependency in (
                "zephon_loader.contract", "zephon_loader.errors", "zephon_loader.fields"), (name, dependency)


def _zephon_private_names() -> set[str]:
    """Private attribute names of Zephon's public objects a loader holds (its ``Pipeline``, built and configured)."""
    zephon = pytest.importorskip("zephon")
    names = {n for n in dir(zephon.Pipeline) if n.startswith("_") and not n.startswith("__")}
    source = zephon.StaticMixtureWorkSource if hasattr(zephon, "StaticMixtureWorkSource") else None
    if source is not None:
        names |= {n for n in dir(source) if n.startswith("_") and not n.startswith("__")}
    try:  # instance attributes of a pipeline (``_options``, ``_engine`` ...), from its constructor's source
        import inspect

        init = inspect.getsource(zephon.Pipeline.__init__)
        names |= {node.attr for node in ast.walk(ast.parse(init.strip() if init.startswith(" ") else init))
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and node.attr.startswith("_") and not node.attr.startswith("__")}
    except (OSError, TypeError, SyntaxError):
        pass
    return names | {"_options", "_engine"}


def test_only_zephon_compat_touches_zephon_private_names():
    private = _zephon_private_names()
    offences = []
    for name, path in MODULES.items():
        if name == COMPAT:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zephon._"):
                offences.append(f"{name}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offences += [f"{name}:{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("zephon._")]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    "zephon._internal" in node.value or node.value == "WorkerCrashed"):
                if not _is_docstring(tree, node):
                    offences.append(f"{name}:{node.lineno}: names {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                offences.append(f"{name}:{node.lineno}: reads .{node.attr} of {ast.unparse(node.value)}")
    assert offences == []


def test_the_private_name_check_sees_an_offence(tmp_path):
    """The check above is not blind: the same walk flags a module that reads ``pipeline._options``."""
    tree = ast.parse("def f(pipeline):\n    return pipeline._options\n")
    private = _zephon_private_names()
    assert "_options" in private
    assert [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in private] == ["_options"]


def _is_docstring(tree: ast.AST, constant: ast.Constant) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and first.value is constant:
                return True
    return False


def test_no_module_cites_a_file_outside_the_repository():
    """Docstrings point to ``docs/contract.md``, which ships with the project, never to a design file users lack."""
    repository = PACKAGE.parent
    assert (repository / "docs" / "contract.md").is_file()
    citing = [name for name, path in MODULES.items() if "SPEC §" in path.read_text()]
    assert citing == []
