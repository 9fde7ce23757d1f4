"""par's modules and packages import each other without a cycle, no concept imports the course tooling, and the
README's package map lists exactly the folders and modules in the tree. Static: the sources are parsed (ast),
nothing is imported."""
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


def package_of(module: str) -> str:
    """The folder a module lives in: `par.zero.engine` -> `par.zero`; the top-level modules -> `par`."""
    parts = module.split(".")
    if MODULES[module].name == "__init__.py":
        return module
    return ".".join(parts[:-1])


def package_graph(top_level_only: bool) -> dict:
    graph = {}
    for m, p in MODULES.items():
        edges = {package_of(w) for w in imported(p, top_level_only)} - {package_of(m)}
        graph.setdefault(package_of(m), set()).update(edges)
    return graph


def test_the_import_graph_is_acyclic():
    """No two par modules import each other, at module level (what Python executes on import) nor inside
    functions."""
    graph = {m: imported(p, top_level_only=True) for m, p in MODULES.items()}
    assert cycles(graph) == [], "par modules that import each other at module level"
    full = {m: imported(p, top_level_only=False) for m, p in MODULES.items()}
    assert cycles(full) == [], "par modules that import each other in functions"


def test_the_packages_import_each_other_without_a_cycle():
    """Folders as units: no two of par's packages (the top-level modules count as `par`) import each other,
    even through function-level imports; so each lecture's folder can be read after the ones it builds on."""
    assert cycles(package_graph(top_level_only=False)) == [], "par packages that import each other"


def test_no_concept_imports_the_course_tooling():
    """`par.course` may import every concept; nothing outside it imports `par.course` (the command line
    names its command modules as strings)."""
    offenders = sorted(f"{m} -> {w}" for m, p in MODULES.items() if not m.startswith("par.course")
                       for w in imported(p, top_level_only=False) if w.startswith("par.course"))
    assert offenders == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert imported(PAR / "zero" / "engine.py", top_level_only=True) >= {"par.zero.flat", "par.zero.units"}
    assert package_of("par.zero.engine") == "par.zero" and package_of("par.model") == "par"
    assert package_of("par.zero") == "par.zero"


def readme_map() -> dict[str, list[str]]:
    """The README's "## The package" table: {folder: [the modules it names]}. The folder is the backticked
    `par/NAME/` (or `par/`) that opens a row; the modules are the backticked names that open each
    comma-separated item of the last column (a backticked word inside parentheses is not a module)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## The package\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        folder = re.match(r"`(par/(?:\w+/)*)`", cells[0]) if len(cells) >= 2 else None
        if not folder:
            continue
        names, depth, item = [], 0, ""
        for ch in cells[-1] + ",":            # split on commas outside parentheses
            depth += (ch == "(") - (ch == ")")
            if ch == "," and depth == 0:
                m = re.match(r"\s*`([\w.]+)`", item)
                if m:
                    names.append(m.group(1))
                item = ""
            else:
                item += ch
        assert folder.group(1) not in rows, f"{folder.group(1)} has two rows"
        rows[folder.group(1)] = names
    return rows


def test_the_readme_package_map_lists_exactly_the_folders_and_modules():
    tree: dict[str, set] = {}
    for m, p in MODULES.items():
        if m in ("par", "par.__main__") or p.name == "__init__.py":
            continue
        folder = "par/" if package_of(m) == "par" else package_of(m).replace(".", "/") + "/"
        tree.setdefault(folder, set()).add(m.rpartition(".")[2])
    listed = readme_map()
    assert sorted(listed) == sorted(tree), "the README's package map has one row per folder of par/"
    for folder, names in listed.items():
        assert len(names) == len(set(names)), f"{folder}: a module listed twice"
        assert sorted(tree[folder] - set(names)) == [], f"modules in {folder} that the README's map does not list"
        assert sorted(set(names) - tree[folder]) == [], f"the README's map names modules {folder} lacks"


def function_level_imports(path: Path) -> list[int]:
    """The lines of `path`'s imports of par modules that sit inside a function (where a reader of the module's head
    does not see them)."""
    tree = ast.parse(path.read_text())
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "par" for a in n.names) or (
                        isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "par"):
                    lines.append(n.lineno)
    return sorted(set(lines))


def test_par_imports_sit_at_the_head_of_their_module():
    """Every import of a par module is at module level, where a reader of the module's head sees it, except the
    few that defer a heavy import (torch, the launcher) to the call that needs it: each says so on its line, and
    there are at most 40."""
    found = {p: function_level_imports(p) for p in MODULES.values()}
    unexplained = sorted(f"{p.relative_to(ROOT)}:{line}" for p, lines in found.items() for line in lines
                         if "#" not in p.read_text().splitlines()[line - 1])
    assert unexplained == [], "imports inside functions without their reason: move them to the module's head"
    assert sum(map(len, found.values())) <= 40


def test_the_import_finder_finds_an_import_inside_a_function(tmp_path):
    (tmp_path / "m.py").write_text("import os\nfrom par import clock\n\ndef f():\n    from par.runtime import dist\n"
                                   "    import par.model   # a reason\n    import json\n    return dist\n")
    assert function_level_imports(tmp_path / "m.py") == [5, 6]
