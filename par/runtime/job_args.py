"""A job's arguments as one typed object: declared once, read by the job, built by whoever launches it.

A job declares its options as the fields of a frozen dataclass (type, default, help text); the field
`bucket_kb` is the option `--bucket-kb`. `parse(argv)` is the job's argparse, built from the fields;
`to_argv()` is the command line that parses back to the same object (only what differs from the defaults):

    @dataclass(frozen=True)
    class Args(JobArgs):
        preset: str = arg("tiny", "a par.model preset")
        steps: int = arg(20, "optimizer steps")
        dtypes: tuple[str, ...] = arg(("fp32",), "comma-separated")
        micro_batch: int | None = arg(None, "default: the whole batch")
        check: bool = arg(False, "compare with single-process training")

    Args(steps=5, dtypes=("fp32", "bf16"), check=True).to_argv()
        # ['--steps', '5', '--dtypes', 'fp32,bf16', '--check']
    Args.parse(["--steps", "5", "--check"]) == Args(steps=5, check=True)      # True

Types: str, int, float; `X | None` (None: not given); bool, a flag (default False); `tuple[X, ...]`,
comma-separated, or one option per item with `arg(..., repeat=True)` (items that contain commas); and any
class X with `X.parse(text)` whose `str(x)` is the text it parses (e.g. `par.zero.job.ZeroRun`).
`arg(..., choices=...)` checks every value, `arg(..., minimum=1)` every number (steps, sizes: an
`argparse.ArgumentError` naming the option wherever the arguments are made, in the launcher when it builds
them, before any rank starts); a field without a default is a required option.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Self


def arg(default=dataclasses.MISSING, help: str = "", *, repeat: bool = False, choices=None, minimum=None):
    """A field of a `JobArgs`: its default (none: required), --help text, `repeat` (a tuple given as one
    option per item), `choices` (the values allowed) and `minimum` (the smallest number allowed)."""
    return dataclasses.field(default=default, metadata={"help": help, "repeat": repeat, "choices": choices,
                                                        "minimum": minimum})


def item_type(tp) -> tuple[type, bool]:
    """(the type of one value, whether the field is a tuple of them): `tuple[int, ...]` -> (int, True),
    `int | None` -> (int, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(t for t in typing.get_args(tp) if t is not type(None))
    if typing.get_origin(tp) is tuple:
        return typing.get_args(tp)[0], True
    return tp, False


def value_parser(tp, choices=None, many: bool = False):
    """text -> one value of type `tp` (`tp.parse(text)` where it has one) among `choices`; `many`: a
    comma-separated tuple of them."""
    convert = getattr(tp, "parse", tp)

    def one(text: str):
        try:
            value = convert(text)
        except ValueError as e:      # argparse shows the message (a class's parse says what it accepts)
            raise argparse.ArgumentTypeError(str(e)) from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(map(str, choices))}")
        return value

    def parse(text: str):
        return tuple(one(t) for t in text.split(",") if t) if many else one(text)
    return parse


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class JobArgs:
    """The base of a job's `Args`: subclasses are frozen dataclasses whose fields are made by `arg`."""

    def __post_init__(self):
        """Every number at least its field's `minimum` (each item of a tuple; None is "not given")."""
        for f in dataclasses.fields(self):
            low, value = f.metadata.get("minimum"), getattr(self, f.name)
            too_small = [v for v in (value if isinstance(value, tuple) else (value,))
                         if low is not None and v is not None and v < low]
            if too_small:
                raise argparse.ArgumentError(None, f"{flag(f.name)} must be at least {low}, got {too_small[0]}")

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """The argparse parser the fields describe."""
        doc = sys.modules[cls.__module__].__doc__ or ""
        ap = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, many = item_type(hints[f.name])
            meta, required = f.metadata, f.default is dataclasses.MISSING
            if tp is bool:
                ap.add_argument(flag(f.name), action="store_true", help=meta["help"])
                continue
            if meta["repeat"]:
                how = dict(action="append", type=value_parser(tp, meta["choices"]),
                           default=None if required else list(f.default))
            else:
                how = dict(type=value_parser(tp, meta["choices"], many), default=f.default)
            ap.add_argument(flag(f.name), required=required, help=meta["help"], **how)
        return ap

    @classmethod
    def parse(cls, argv=None) -> Self:
        """The arguments `argv` gives (default: the command line's); argparse's errors and --help."""
        values = vars(cls.parser().parse_args(argv))
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    def to_argv(self) -> list[str]:
        """The command line that parses back to these arguments: every field that differs from its default."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default or value is False:
                continue
            if value is True:
                out.append(flag(f.name))
            elif f.metadata["repeat"]:
                out += [x for v in value for x in (flag(f.name), str(v))]
            elif isinstance(value, (tuple, list)):
                out += [flag(f.name), ",".join(map(str, value))]
            else:
                out += [flag(f.name), str(value)]
        return out
