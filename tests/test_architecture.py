"""The house rules, read from the source (nothing is imported or run):
- no import cycle among the project's modules (imports inside functions count too; only
  `if TYPE_CHECKING:` blocks are skipped, they never run);
- imports flow one way: sgl_dflash may use jax_backend and torchax_proposer, never the reverse,
  and those two do not use each other; nothing in the runtime imports the tooling;
- no file over MAX_LINES lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sgl_dflash", "jax_backend", "torchax_proposer")
MAX_LINES = 400
TOOLING = ("sgl_dflash.tools", "sgl_dflash.train", "sgl_dflash.bench", "sgl_dflash.demo",
           "sgl_dflash.datasets", "sgl_dflash.model_import")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports, anywhere in the file but `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                found.update(_resolve(alias.name, modules) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the file's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (child.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else _resolve(base, modules))
            visit(child)

    visit(tree)
    found.discard(None)
    found.discard(name)
    return found


def _resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
            connect(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_imports_flow_one_way():
    bad = []
    for module, imported in import_graph().items():
        top = module.split(".")[0]
        for target in imported:
            other = target.split(".")[0]
            if top != "sgl_dflash" and other != top:
                bad.append(f"{module} -> {target} ({top} must not use {other})")
            runtime = top == "sgl_dflash" and not module.startswith(TOOLING)
            if runtime and target.startswith(TOOLING):
                bad.append(f"{module} -> {target} (the runtime must not use the tooling)")
    assert not bad, "\n".join(bad)


def test_no_file_over_the_line_limit():
    long = {}
    for path in project_modules().values():
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[rel] = lines
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
