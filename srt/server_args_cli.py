"""`ServerArgs`' fields as command-line flags: one flag per field (`--tp-size` for `tp_size`), its default
the field's, its help and choices the field's metadata, its value converted to the field's type. Apart
from `server_args.py` so that the field list reads there alone and the parser's construction here, as the
rules read in `server_args_check.py`; generated from the fields, a flag cannot exist without its field or
default to something else. Generic over the dataclass (no import of `server_args`, which imports this);
torch-free, as `server_args` is: both run in the HTTP process."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TypeVar

T = TypeVar("T")

# A field's annotation (a string: annotations are postponed) -> the type argparse converts its flag's value
# to; bool fields are store_true flags. A field of any other annotation fails at parser construction rather
# than parsing as a string (a `float | None` once reached the range check as a str).
CLI_TYPES: dict[str, type] = {
    "str": str, "str | None": str, "list[str] | None": str,
    "int": int, "int | None": int,
    "float": float, "float | None": float, "list[float] | None": float,
}  # fmt: skip


def add_flags(cls: type, parser: argparse.ArgumentParser) -> None:
    """One flag per field of the dataclass `cls`: bools as store_true, the rest typed by CLI_TYPES."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = CLI_TYPES[str(f.type)]
        parser.add_argument(
            flag, type=kind, default=default, help=f"{help_text} (default: %(default)s)", **meta
        )


def from_namespace(cls: type[T], args: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def parse_flags(cls: type[T], argv: list[str] | None = None) -> T:
    """`cls` from a command line; a bad value or a combination `cls` refuses (a ValueError from its
    validation) is argparse's one error line and exit 2."""
    parser = argparse.ArgumentParser(
        prog="python -m srt.launch_server",
        usage="%(prog)s [options] (--help lists them)",  # one line above the error, not 60
        description="Start the srt server.",
    )
    add_flags(cls, parser)
    args = parser.parse_args(argv)
    try:
        return from_namespace(cls, args)
    except ValueError as e:
        parser.error(str(e))
