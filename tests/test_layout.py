"""The package's layout as its imports draw it: no import cycle between modules, models/
depends on nothing but config, train/ reads checkpoints through the one loader (never interop/
directly), rundir.py owns the run layout (importing nothing from train/), no source file past
800 lines, and docs/architecture/README.md draws exactly these arrows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "llm_foundry"
DOC = ROOT / "docs" / "architecture" / "README.md"


def _module_name(file: Path) -> str:
    parts = list(file.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every llm_foundry module imported anywhere in ``tree`` (function bodies included: a lazy
    import is still a dependency), except under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (names resolved to existing modules)."""
    files = {_module_name(f): f for f in PKG.rglob("*.py")}
    graph = {}
    for name, file in files.items():
        raw = _imports(ast.parse(file.read_text()), name, file.name == "__init__.py")
        graph[name] = {m for m in raw if m in files and m != name}
    return graph


def unit(module: str) -> str:
    """The box a module is drawn in: its subpackage (cli, models, train, ...) or itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in module_graph().items():
        if module == "llm_foundry":
            continue
        out.setdefault(unit(module), set()).update(
            unit(d) for d in deps if d != "llm_foundry" and unit(d) != unit(module)
        )
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycle_between_modules():
    graph = module_graph()
    # a package's __init__ re-exporting its submodules is not a cycle of the design
    for name in list(graph):
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".")}
    assert _cycles(graph) == []
    # nor between packages: a unit (cli, models, train, data, ...) never imports one that
    # imports it back
    assert _cycles(unit_graph()) == []


def test_models_depend_on_config_alone():
    graph = module_graph()
    for module, deps in graph.items():
        if module.startswith("llm_foundry.models"):
            outside = {d for d in deps if not d.startswith("llm_foundry.models")}
            allowed = {"llm_foundry.config", "llm_foundry.messages"}
            assert outside <= allowed, f"{module} imports {sorted(outside)}"
    # how errors show values: a leaf every layer may use
    assert graph["llm_foundry.messages"] == set()


def test_training_reads_checkpoints_through_the_one_loader():
    """train/ starts from HF directories through ``loading.load_any``, never by importing interop/;
    the run directory's layout belongs to rundir, which the training side asks, not the other
    way round."""
    graph = module_graph()
    for module, deps in graph.items():
        if module.startswith("llm_foundry.train"):
            interop = sorted(d for d in deps if d.startswith("llm_foundry.interop"))
            assert not interop, f"{module} imports {interop}"
    train = sorted(d for d in graph["llm_foundry.rundir"] if d.startswith("llm_foundry.train"))
    assert not train, f"llm_foundry.rundir imports {train}"


MAX_LINES = 800


def test_no_source_file_is_over_800_lines():
    """A file past this many lines holds more than one concern: split it."""
    long = {
        str(f.relative_to(ROOT)): n
        for f in sorted(PKG.rglob("*.py"))
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"over {MAX_LINES} lines: {long}"


def reduction(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The arrows of an acyclic ``graph`` that no longer path implies (its transitive reduction):
    what a diagram needs to show every dependency, directly or through others."""

    def reachable(start: str, skip: tuple[str, str]) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            v = todo.pop()
            for w in graph.get(v, ()):
                if (v, w) != skip and w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    return {(a, b) for a, deps in graph.items() for b in deps if b not in reachable(a, (a, b))}


def test_architecture_doc_draws_the_imports():
    """The ``%% imports`` mermaid block of docs/architecture/README.md draws exactly the
    unit-level import arrows, less those another path already implies."""
    text = DOC.read_text()
    block = re.search(r"```mermaid\n(%% imports.*?)```", text, re.S)
    assert block, f"{DOC} has no ```mermaid block starting with '%% imports'"
    drawn = set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", block.group(1), re.M))
    graph = unit_graph()
    assert _cycles(graph) == [], "units import each other in a cycle"
    actual = reduction(graph)
    expected = "\n".join(f"    {a} --> {b}" for a, b in sorted(actual))
    assert drawn == actual, (
        f"{DOC}: the diagram differs from the imports; missing {sorted(actual - drawn)}, "
        f"extra {sorted(drawn - actual)}. The arrows as the code has them:\n{expected}"
    )
