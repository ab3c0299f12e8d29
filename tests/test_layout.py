"""The layout the README describes, held: no import cycle between the project's modules, no
module over 600 lines in the engine, model and kernel packages, and few modules at the top of
jaxrunner/ (everything else lives in a stage or feature package)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxrunner", "models", "kernels_pallas", "kernels_cpu")
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 8


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in the file (a function-level import still
    closes a cycle), except under `if TYPE_CHECKING:`. `from pkg import x` counts `pkg.x` when
    that is a module. A module's own parent packages are left out: importing a sibling runs
    their __init__ first, which is not a cycle."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for statement in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found.add(base)
                found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    cycles.append(sorted(component))
    return cycles


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    modules = project_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert import_cycles(graph) == []


def test_no_module_over_600_lines():
    long = {str(path.relative_to(ROOT)): n for path in project_modules().values()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_few_modules_at_the_top_of_jaxrunner():
    top = sorted(p.name for p in (ROOT / "jaxrunner").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
