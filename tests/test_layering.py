"""The house's layering (DESIGN.md, "Layout"): every module of the package, its imports read from
the source, checked for cycles, for imports of the project hidden inside functions (the way a
cycle is usually dodged), and for the direction of the layers:

    samples -> entry -> {passes, tools} -> {lowering, swap} -> ep -> cost

(an arrow: may import; no layer imports one above it or beside it). If this fails, move the
shared piece down to a layer both sides may import, not the import into a function.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed package -> directory in the repository (pyproject's package-dir)
DIRS = {"moe_compile": "moe_compile", "moe_compile.passes": "passes", "moe_compile.lowering": "lowering",
        "moe_compile.cost": "cost", "moe_compile.samples": "samples"}
RANK = {"samples": 6, "entry": 5, "passes": 4, "tools": 4, "lowering": 3, "swap": 3, "ep": 2, "cost": 1}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "moe_compile" and parts and parts[0] in ("passes", "lowering", "cost", "samples"):
                continue  # not a directory of moe_compile/ in the repository
            out[name] = path
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("passes", "lowering", "cost", "samples", "ep", "swap", "tools"):
        return parts[1]
    return "entry"


def imports(name: str, path: Path, known: set[str]) -> tuple[set[str], list[str]]:
    """(project modules ``name`` imports at module level, those it imports inside a function)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    top: set[str] = set()
    local: list[str] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            package = name if is_package else name.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                package = package.rsplit(".", 1)[0]
            base = f"{package}.{base}" if base else package
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for t in targets(child):
                    while t and t not in known:  # `import moe_compile.lowering.x` -> its module
                        t = t.rpartition(".")[0]
                    if t and t != name:
                        (local.append(t) if in_function else top.add(t))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return top, local


def graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    mods = modules()
    known = set(mods)
    edges, local = {}, {}
    for name, path in mods.items():
        edges[name], local[name] = imports(name, path, known)
    return edges, local


def test_the_package_is_read_whole() -> None:
    mods = modules()
    assert {"moe_compile.backend", "moe_compile.ep.runtime", "moe_compile.swap.swapper", "moe_compile.tools.calibrate",
            "moe_compile.passes.canonicalize", "moe_compile.lowering.hier_a2a", "moe_compile.cost.routing"} <= set(mods)


def test_no_import_cycle() -> None:
    edges, _ = graph()
    # a package's __init__ re-exports what lies below it; an edge into it is one into those modules
    try:
        tuple(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_no_project_import_inside_a_function() -> None:
    _, local = graph()
    hidden = {m: ts for m, ts in local.items() if ts}
    assert not hidden, f"function-local imports of the project (move the module level import up, or the shared piece down): {hidden}"


def test_imports_run_down_the_layers() -> None:
    edges, _ = graph()
    upward = [(m, t) for m, ts in edges.items() for t in ts
              if layer(m) != layer(t) and RANK[layer(t)] >= RANK[layer(m)]]
    assert not upward, f"imports against the layering {list(RANK)}: {upward}"
