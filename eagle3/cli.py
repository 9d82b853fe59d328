"""A CLI generated from a config dataclass: one flag per field, its default the field's, its help
the field's docstring (read from the source once), so a setting is defined in one place."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: its docstring}`` (the string literal under the field in the body of the class, or of
    the class it inherits the field from)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _scalar(hint: Any) -> tuple[Any, bool]:
    """(the annotation without ``None``, whether ``None`` was allowed)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, required: tuple[str, ...] = (),
                            aliases: dict[str, str] | None = None, skip: tuple[str, ...] = (),
                            defaults: dict[str, Any] | None = None, prefix: str = "") -> None:
    """One ``--field-name`` per field of ``cls`` (``aliases``: an extra spelling, e.g. out_dir ->
    --out): bools as ``--x/--no-x``, lists space-separated, ``X | None`` fields default None. A field
    that is itself a dataclass (a section) gives ``--section.field-name`` flags, its dest
    ``section.field_name`` (``required``, ``aliases``, ``skip`` and ``defaults`` name them so too)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        name = prefix + f.name
        if name in skip:
            continue
        kind, optional = _scalar(hints[f.name])
        if is_dataclass(kind):
            add_dataclass_arguments(parser, kind, required=required, aliases=aliases, skip=skip, defaults=defaults,
                                    prefix=name + ".")
            continue
        flags = ["--" + name.replace("_", "-")] + ([aliases[name]] if aliases and name in aliases else [])
        if defaults and name in defaults:
            default = defaults[name]
        else:
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        shown = ("required" if name in required
                 else f"default {default!r}" + (" (None: unset)" if optional and default is None else ""))
        help_ = f"{text} ({shown})" if text else shown
        if kind is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_)
        elif typing.get_origin(kind) is list:
            parser.add_argument(*flags, dest=name, nargs="+" if name in required else "*",
                                type=typing.get_args(kind)[0], default=default, required=name in required,
                                help=help_ + "; space-separated")
        else:
            parser.add_argument(*flags, dest=name, type=kind, default=default, required=name in required,
                                help=help_)


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """``cls`` built from the parsed flags of :func:`add_dataclass_arguments` (and ``overrides``)."""
    return cls(**{**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}, **overrides})


def parse_moved(parser: argparse.ArgumentParser, argv: Any, moved: dict[str, str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but a flag of an earlier version (``moved``: old field name -> its
    dotted place now) is refused in one line naming its new flag (``--lr is now --optim.lr``)."""
    parsed, unknown = parser.parse_known_args(argv)
    for flag in unknown:
        name = flag.split("=")[0].removeprefix("--").removeprefix("no-").replace("-", "_")
        if flag.startswith("--") and name in moved:
            parser.error(f"--{name.replace('_', '-')} is now --{moved[name].replace('_', '-')}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return parsed


__all__ = ["add_dataclass_arguments", "dataclass_from_args", "field_docs", "parse_moved"]
