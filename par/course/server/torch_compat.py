"""`python -m par torch-compat WHEEL`: is every torch name par uses defined in another torch release?

par runs on torch from 2.11 on; the project pins 2.13, where the suite runs. A GPU server's torch is often older. Its
CPU wheel is on PyTorch's own index and its PyPI wheel is the CUDA build, which imports only beside gigabytes of
CUDA libraries: so this check reads the release's Python sources and type stubs straight from its wheel (a zip),
never importing it (`pip download --no-deps torch==2.11.0` fetches the wheel).

    used_names(par)     every dotted torch name par's code uses: `torch.nn.functional.scaled_dot_product_attention`
                        from `import torch.nn.functional as F` and `F.scaled_dot_product_attention`, `from torch.x
                        import y`, attribute chains on any name bound to a torch module
    defines(source, n)  the longest prefix of `n` that is a module of the release (torch/a/b.py, torch/a/b/__init__.py,
                        their .pyi stubs) must name the next part: as a word of its text or of the modules it
                        star-imports (torch/__init__.py's `from torch._C._VariableFunctions import *`)

The check is differential: a name counts as missing only where the installed torch defines it by that rule and the
other release does not (a name neither text shows, made at run time, is counted as undecided, not as missing).
Only names are checked, not signatures: a keyword argument added in a later release is not caught here.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from par.runtime.paths import ROOT

STAR = re.compile(r"^\s*from\s+(torch[\w.]*|\.+[\w.]*)\s+import\s+\*", re.M)


@dataclass(frozen=True)
class Use:
    name: str          # torch.nn.functional.scaled_dot_product_attention
    where: str         # par/model.py:63


def torch_aliases(tree: ast.AST) -> dict[str, str]:
    """{local name: the torch module or object it is bound to} from a module's imports (any scope)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                if a.name != "*":
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None for anything that is not a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def used_in(source: str, where: str) -> list[Use]:
    """The torch names one module of par uses: its imports, and the longest chains on a name bound to torch."""
    tree = ast.parse(source)
    aliases = torch_aliases(tree)
    uses = [Use(full, where) for full in sorted(set(aliases.values()))]
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}   # part of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = dotted(node)
            if chain and chain[0] in aliases:
                uses.append(Use(".".join([aliases[chain[0]], *chain[1:]]), f"{where}:{node.lineno}"))
    return uses


def used_names(package: Path) -> dict[str, str]:
    """{torch name: the first place in `package` that uses it}, over every .py file of `package`."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package.parent))
        for use in used_in(path.read_text(encoding="utf-8"), where):
            found.setdefault(use.name, use.where)
    return dict(sorted(found.items()))


class Source:
    """A torch release's Python sources and stubs by path ("torch/nn/functional.py"): an installed folder or a
    wheel, read without importing anything."""

    def __init__(self, where: Path):
        self.where = Path(where)
        self._zip = zipfile.ZipFile(self.where) if self.where.is_file() else None
        self._names = set(self._zip.namelist()) if self._zip else None
        self._words: dict[str, frozenset | None] = {}

    def words(self, module: str) -> frozenset | None:
        """The words of `module_text(module)`, kept: every name is looked up in a few modules."""
        if module not in self._words:
            text = self.module_text(module)
            self._words[module] = None if text is None else frozenset(re.findall(r"\w+", text))
        return self._words[module]

    def text(self, rel: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8", "replace") if rel in self._names else None
        path = self.where / rel
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None

    def version(self) -> str:
        found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", self.text("torch/version.py") or "")
        return found.group(1) if found else "?"

    def module_text(self, module: str, depth: int = 2) -> str | None:
        """The text of `module` (its .py and .pyi, as a file or a package), with the modules it star-imports
        (`depth` levels); None where the release has no such module."""
        rel = module.replace(".", "/")
        as_file = [t for t in (self.text(f"{rel}{ext}") for ext in (".py", ".pyi")) if t is not None]
        as_package = [t for t in (self.text(f"{rel}{ext}") for ext in ("/__init__.py", "/__init__.pyi"))
                      if t is not None]
        texts = as_file + as_package
        if not texts:
            return None
        if depth:
            here = module if as_package else module.rsplit(".", 1)[0]
            for star in {absolute(m, here) for t in texts for m in STAR.findall(t)} - {module}:
                texts.append(self.module_text(star, depth - 1) or "")
        return "\n".join(texts)


def absolute(module: str, package: str) -> str:
    """`from .x import *` in `package` names `package.x` (`..x`: one package up)."""
    if not module.startswith("."):
        return module
    dots = len(module) - len(module.lstrip("."))
    base = package.rsplit(".", dots - 1)[0] if dots > 1 else package
    rest = module.lstrip(".")
    return f"{base}.{rest}" if rest else base


def defines(source: Source, name: str) -> bool | None:
    """Whether `source` defines `name` (torch.a.b.c): the longest module prefix names the next part as a word of its
    text. None where no prefix but `torch` is a module and `torch` does not name it either (made at run time)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        words = source.words(".".join(parts[:cut]))
        if words is None:
            continue
        return cut == len(parts) or parts[cut] in words
    return None


def missing(names: dict[str, str], reference: Source, other: Source) -> tuple[list[tuple[str, str]], int, int]:
    """([(name, where)] the reference defines and `other` does not, checked, undecided)."""
    gone, checked, undecided = [], 0, 0
    for name, where in names.items():
        if not defines(reference, name):
            undecided += 1
            continue
        checked += 1
        if not defines(other, name):
            gone.append((name, where))
    return gone, checked, undecided


def installed_torch() -> Path:
    """The folder holding the installed torch package (its parent: paths are "torch/...")."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par torch-compat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path, help="a torch wheel (.whl) or a folder holding torch/ (site-packages)")
    args = parser.parse_args(argv)
    if not (args.wheel.is_dir() and (args.wheel / "torch").is_dir()) and not zipfile.is_zipfile(args.wheel):
        print(f"error: {args.wheel} is neither a torch wheel nor a folder holding torch/: fetch one with "
              f"`pip download --no-deps torch==2.11.0 -d DIR`", file=sys.stderr)
        return 2
    try:
        reference, other = Source(installed_torch()), Source(args.wheel)
        if other.text("torch/__init__.py") is None:
            print(f"error: {args.wheel} holds no torch package (torch/__init__.py): a wheel of another package? "
                  f"fetch torch's with `pip download --no-deps torch==2.11.0 -d DIR`", file=sys.stderr)
            return 2
        names = used_names(ROOT / "par")
        gone, checked, undecided = missing(names, reference, other)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        print(f"error: {args.wheel} is damaged and cannot be read ({type(e).__name__}: {e}): download it again",
              file=sys.stderr)
        return 2
    print(f"par uses {len(names)} torch names: {checked} checked against torch {other.version()} "
          f"(installed: {reference.version()}), {undecided} made at run time and not decidable from the sources")
    for name, where in gone:
        print(f"  missing in torch {other.version()}: {name} (used at {where})")
    print(f"all {checked} defined in torch {other.version()}" if not gone else
          f"{len(gone)} of them missing in torch {other.version()}")
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main())
