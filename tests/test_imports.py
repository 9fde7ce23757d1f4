"""par's modules import each other without a cycle (issue 15), and the README's package map lists exactly the
modules in the tree. Static: the sources are parsed (ast), nothing is imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAR = ROOT / "par"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PAR.rglob("*.py"))}


def imported(path: Path, top_level_only: bool) -> set[str]:
    """The par modules `path` imports (at module level only, or anywhere, functions included)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:      # module level, including inside if/try blocks at module level
        nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    out = set()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for n in nodes:
        names = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - n.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in n.names]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != me and name != "par":
                out.add(name)
    return out


def cycles(graph: dict) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_acyclic():
    """No two par modules import each other at module level (what Python executes on import). The only
    mutual reference through a function-level import is allowed explicitly: the `exercises` command line
    hands `release DIR` to `par.release`, which builds the bundle with `par.exercises`."""
    graph = {m: imported(p, top_level_only=True) for m, p in MODULES.items()}
    assert cycles(graph) == [], "par modules that import each other at module level"
    full = {m: imported(p, top_level_only=False) for m, p in MODULES.items()}
    assert cycles(full) in ([], [["par.exercises", "par.release"]]), "par modules that import each other in functions"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert imported(PAR / "zero.py", top_level_only=True) >= {"par.flat", "par.units"}


def readme_map() -> list[str]:
    """The modules the README's "## The package" table names: the backticked name that opens each
    comma-separated item of the modules column (a backticked word inside parentheses is not a module)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## The package\n", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or set(cells[1]) <= set("-: "):
            continue
        depth, item = 0, ""
        for ch in cells[1] + ",":            # split on commas outside parentheses
            depth += (ch == "(") - (ch == ")")
            if ch == "," and depth == 0:
                m = re.match(r"\s*`([\w.]+)`", item)
                if m:
                    names.append(m.group(1))
                item = ""
            else:
                item += ch
    return names


def test_the_readme_package_map_lists_exactly_the_modules():
    tree = {m.removeprefix("par.") for m in MODULES if m not in ("par", "par.__main__")
            and not (MODULES[m].name == "__init__.py")}
    listed = readme_map()
    assert len(listed) == len(set(listed)), "a module listed twice"
    assert sorted(tree - set(listed)) == [], "modules in par/ that the README's package map does not list"
    assert sorted(set(listed) - tree) == [], "the README's package map names modules that do not exist"
