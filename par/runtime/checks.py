"""Checks of a command line that need only its values and the file system, shared by every command.

A mistake found here stops the command before any work or rank starts, as one line `error: ...` and
exit 2 (`python -m par`, par/__main__.py):

    ap.add_argument("--steps", type=positive_int)            # 0, -1, "two": argparse's one-line error
    ap.add_argument("--world-sizes", type=world_sizes)       # "2,4" -> (2, 4); every one >= 1
    check_writable(args.json)                                # before the benchmark, not after it
    write_atomic(path, text)                                 # tmp + fsync + rename: all of it or nothing
    env_number("PAR_HANG_S", 45.0, minimum=0)                # "45s": CheckError naming PAR_HANG_S
    unknown("benchmark", "colectives", BENCHMARKS, "python -m par bench --help")   # did you mean 'collectives'?

This module imports nothing heavy (no torch): a refusal comes within a second.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import os
import tempfile
from pathlib import Path


class CheckError(ValueError):
    """An argument that cannot work (an output path that cannot be written): one line naming the fix."""


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (ranks, steps, sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def int_at_least(minimum: int, why: str):
    """argparse type: a whole number >= minimum (0 for counts of warm-up steps); below it the error says `why`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} ({why}), got {value}")
        return value
    return parse


def int_at_most(maximum: int, why: str):
    """argparse type: a whole number in [1, maximum]; above it the error says `why` there is a bound."""
    def parse(text: str) -> int:
        value = positive_int(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,} ({why}), got {value:,}")
        return value
    return parse


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (seconds, bytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def _plain(x: float) -> str:
    """A number as a person types it: 1048576, 0.5 (not 1.04858e+06)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def env_number(name: str, default: float, minimum: float = 0.0) -> float:
    """The number in environment variable `name` (`default` when unset or empty): finite and >= `minimum`,
    else `CheckError` naming the variable ("PAR_HANG_S='45s' is not a number ...")."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        raise CheckError(f"{name}={text!r} is not a number >= {_plain(minimum)}: fix it (e.g. {name}={_plain(default)}) "
                         f"or unset it for the default")
    return value


def world_sizes(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated world sizes, each >= 1: '2,4' -> (2, 4)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers of ranks such as 2,4, got {text!r}")
    try:
        return tuple(positive_int(t) for t in items)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"every world size {e}") from None


def unknown(kind: str, word: str, choices, see: str) -> str:
    """The message for a mistyped name, with the nearest choice when one is near (difflib):
    "unknown benchmark 'colectives': did you mean 'collectives'? (use one of ...; see ...)"."""
    near = difflib.get_close_matches(word, sorted(choices), n=1)
    every = ", ".join(sorted(choices))
    if near:
        return f"unknown {kind} {word!r}: did you mean {near[0]!r}? (use one of {every}; {see})"
    return f"unknown {kind} {word!r}: use one of {every} ({see})"


def _existing_ancestor(path: Path) -> Path:
    """`path` itself, or the nearest folder above it that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _no_broken_link(path, target: Path) -> None:
    """CheckError when `target` or a folder above it is a link that leads nowhere (a loop, or a missing target):
    writing there would fail only at the first write."""
    import errno
    for p in (target, *target.parents):
        if p.is_symlink():
            try:
                p.stat()
            except OSError as e:
                why = "a loop of links" if e.errno == errno.ELOOP else f"its target {os.readlink(p)} is missing"
                raise CheckError(f"cannot write {path}: {p} is a link that leads nowhere ({why}); remove the link "
                                 f"or choose another path") from None


def check_writable(path, directory: bool = False, parents: bool = False) -> None:
    """Raise `CheckError` unless `path` can be written: a file, or (`directory`) a folder; `parents`: the
    command makes the missing folders above it (a folder always may). Tried by writing, not by reading
    permission bits (root ignores them, a read-only mount does not); nothing is left behind."""
    target = Path(path).absolute()
    _no_broken_link(path, target)
    base = _existing_ancestor(target)
    if base == target and target.is_dir() != directory:
        raise CheckError(f"cannot write {path}: it is {'a file' if directory else 'a folder'}; "
                         f"give the path of a {'folder' if directory else 'file'}")
    if base != target and not base.is_dir():
        raise CheckError(f"cannot write {path}: {base} is a file, not a folder")
    if base != target and base != target.parent and not (directory or parents):
        raise CheckError(f"cannot write {path}: the folder {target.parent} does not exist; create it first")
    try:
        if base == target and not directory:
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
        else:
            with tempfile.TemporaryFile(dir=base):
                pass
    except OSError as e:
        raise CheckError(f"cannot write {path}: {e.strerror} ({base}); choose a path you can write") from None


def write_atomic(path, data: str | bytes) -> None:
    """Write `data` to `path` all at once or not at all: into a temporary file beside it, flushed to disk (fsync),
    then renamed over `path`. A failure (a full disk: ENOSPC; a read-only one) removes the temporary file, leaves
    an earlier `path` as it was, and raises `CheckError` naming the path and the cause."""
    path, tmp = Path(path), None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())     # the mode a plain open() gives, not mkstemp's 0600
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise CheckError(f"cannot write {path}: {e.strerror or e}; free some space there or choose another "
                             f"path") from e
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
