"""The house rules a reader relies on, checked on the source: arrows point one way, and no
module grows past a size a reader can hold without saying why.

Reads the apps' source with ``ast`` (nothing is imported), so it is fast and sees exactly the
imports that run when a module loads: imports inside functions (used to break a task/service
circle) and under ``if TYPE_CHECKING:`` do not count, as they do not run at import time.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ("billing_platform", "metering", "plans", "engine_adapter")
MAX_LINES = 500  # past this, a module's docstring says why (a paragraph starting "Length:")

# HackSoft's pattern lets a service enqueue its task and the task call the service; the
# service side imports inside the function, so even these pairs need no module-level circle.
ALLOWED_CYCLES: set[frozenset[str]] = set()

# (importer prefix, imported prefix): an arrow DESIGN.md says must not exist
FORBIDDEN_ARROWS = (
    ("engine_adapter", "billing_platform"),
    ("engine_adapter", "metering"),
    ("engine_adapter", "plans"),
    ("metering", "billing_platform.gateway"),
    ("metering", "billing_platform.invoicing"),
    ("metering", "billing_platform.console"),
    ("plans", "billing_platform.gateway"),
    ("plans", "billing_platform.invoicing"),
    ("plans", "billing_platform.console"),
    ("billing_platform.invoicing", "billing_platform.gateway"),
    ("billing_platform.accounts", "billing_platform.gateway"),
    ("billing_platform.accounts", "billing_platform.invoicing"),
    # finance composes the others; nothing imports it but the console and the URL map
    *((importer, "billing_platform.finance") for importer in (
        "engine_adapter", "metering", "plans", "billing_platform.accounts",
        "billing_platform.audit", "billing_platform.invoicing", "billing_platform.gateway",
        "billing_platform.idempotency", "billing_platform.api")),
    ("billing_platform.finance", "billing_platform.gateway"),
    ("billing_platform.finance", "billing_platform.console"),
)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if "migrations" in rel.parts or ("sglang_cpu" in rel.parts and "shim" in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Yield the imports that run when the module loads (not in functions or TYPE_CHECKING)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" not in test:
                todo.extend(node.body)
            todo.extend(node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend([*node.body, *node.orelse, *node.finalbody])
            for handler in node.handlers:
                todo.extend(handler.body)
        elif isinstance(node, ast.ClassDef | ast.With):
            todo.extend(node.body)


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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


def _is_package_and_its_own_module(component: list[str]) -> bool:
    """A package's ``__init__`` re-exporting a submodule that imports a sibling through the
    package is one concern, not a circle between two."""
    first = component[0]
    return all(m == first or m.startswith(first + ".") for m in component)


def test_no_import_circle_between_modules():
    # given the apps' module-level imports
    graph = _graph(_modules())
    # then no two modules of different concerns import each other, directly or round about
    circles = [c for c in _cycles(graph)
               if frozenset(c) not in ALLOWED_CYCLES and not _is_package_and_its_own_module(c)]
    assert not circles, "import circles (break them; see docs/architecture.md):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_arrows_point_the_way_the_design_says():
    graph = _graph(_modules())
    wrong = sorted(
        f"{importer} imports {imported}"
        for importer, targets in graph.items() for imported in targets
        for src, dst in FORBIDDEN_ARROWS
        if (importer == src or importer.startswith(src + "."))
        and (imported == dst or imported.startswith(dst + ".")))
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_circle_and_a_wrong_arrow():
    # given a made-up graph with a circle and an allowed chain
    graph = {"a.x": {"a.y"}, "a.y": {"a.x"}, "b": {"a.x"}}
    # then the circle is found and the chain is not
    assert _cycles(graph) == [["a.x", "a.y"]]


def test_no_module_past_the_size_a_reader_holds_without_saying_why():
    long_ones = []
    for name, path in sorted(_modules().items()):
        lines = path.read_text().count("\n")
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "\nLength:" not in f"\n{doc}":
            long_ones.append(f"{name} ({lines} lines)")
    assert not long_ones, (
        f"modules over {MAX_LINES} lines without a 'Length:' paragraph in their docstring "
        "saying why they stay whole:\n" + "\n".join(long_ones))
