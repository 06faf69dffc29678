"""The package's layers (README, Layout): a folder a reader can name, imports that only run down, no circle,
and no import inside a function to dodge one. import-linter checks the order (pyproject's contract, also run
by `make lint`); the two rules it does not state are read from the code here."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from importlinter.cli import lint_imports

from campaign.server.profiles import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "campaign"
LAYERS = ("core", "http", "sim", "server", "measure", "spec", "stored", "plan", "analysis", "report", "night", "bench",
          "tune")
# Over this many lines a module says at its top why it is long (a line starting "Long (").
LONG_LINES = 500


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PROJECT_ROOT).with_suffix("").parts): p for p in sorted(PACKAGE.rglob("*.py"))}


def _campaign_imports(node: ast.AST, module: str) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("campaign"):
        # `from campaign.stored import store` names a module; `from campaign.stored.store import RunDir` a name.
        return [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("campaign")]
    return []


def _module_level_imports(tree: ast.Module) -> list[ast.AST]:
    """Imports run when the module is imported (not a function's, not the `__main__` block's)."""
    found: list[ast.AST] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        found += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


def test_imports_run_only_down_the_layers() -> None:
    assert lint_imports(config_filename=str(PROJECT_ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_every_module_sits_in_a_layer_folder() -> None:
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py", "__main__.py", "cli.py"}
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)


def test_no_campaign_import_inside_a_function() -> None:
    """A deferred import hides a circle (or a layer broken upward) from the reader and from import-linter's
    order; third-party imports kept lazy for speed or for an optional extra are not this rule's business."""
    deferred = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                deferred += [f"{module}:{sub.lineno}" for sub in ast.walk(node) if _campaign_imports(sub, module)]
    assert deferred == []


def test_no_import_circle_between_modules() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {t for node in _module_level_imports(ast.parse(path.read_text()))
                   for t in _campaign_imports(node, module)}
        graph[module] = {t for t in targets if t in modules and t != module}
    # Tarjan's strongly connected components: any with two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert circles == []


def test_a_long_module_says_why_at_its_top() -> None:
    unexplained = []
    for module, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > LONG_LINES and "Long (" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{module} ({lines} lines)")
    assert unexplained == []


def test_every_layer_is_in_the_import_contract() -> None:
    config = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    named = {part.strip() for contract in config["contracts"] for layer in contract["layers"]
             for part in layer.split("|")}
    assert named == {f"campaign.{layer}" for layer in LAYERS} | {"campaign.cli", "campaign.__main__"}
