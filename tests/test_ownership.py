"""Who owns what (issue 55): no par module reaches into another module's private names, and only the process
module (`par.runtime.procs`) walks /proc for processes."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAR = ROOT / "par"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_uses(path: Path) -> list[str]:
    """`from par.x import _y` and `par.x._y` (through an imported module's name) in `path`, of another module."""
    here, tree = module_name(path), ast.parse(path.read_text())
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("par"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and node.module != here:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("par"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value, chain = node.value, []
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = ".".join([aliases[value.id], *reversed(chain)])
                if target != here and target.startswith("par"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [use for path in sorted(PAR.rglob("*.py")) for use in private_uses(path)]
    assert not found, "private names used from another module (make them public, or keep the use inside):\n" + \
        "\n".join(found)


def test_only_the_process_module_walks_proc_for_processes():
    walkers = []
    for path in sorted(PAR.rglob("*.py")):
        if path == PAR / "runtime" / "procs.py":
            continue
        text = path.read_text()
        if 'listdir("/proc")' in text or 'Path("/proc").iterdir' in text or "/task/" in text and "children" in text:
            walkers.append(str(path.relative_to(ROOT)))
    assert not walkers, f"modules that walk /proc for processes (par.runtime.procs owns that): {walkers}"


def test_the_checker_finds_a_private_use(tmp_path):
    path = PAR / "course" / "grading" / "_probe_private_use.py"
    path.write_text("from par.runtime.launch import _comm\nimport par.runtime.dist as d\nx = d._ENV\n")
    try:
        found = private_uses(path)
    finally:
        path.unlink()
    assert len(found) == 2 and "launch import _comm" in found[0] and "par.runtime.dist._ENV" in found[1], found
