"""The one base of every user error the project raises, and the entry points' one way of printing it.

A user error is bad input, settings or files: its message names the key, file or line, and every
entry point (:func:`run_cli`) prints it as one line (``<stage>: error: <message>``) and exits 2,
with no traceback. Each stage's own class (``TrainError``, ``StoreError``, ...) derives from
:class:`Eagle3Error` and keeps the builtin base callers already catch (``ValueError`` or
``RuntimeError``). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Eagle3Error(Exception):
    """Bad input or settings, named in the message."""


class ConfigError(Eagle3Error, ValueError):
    """A setting (a config field or its flag) out of range or unknown; the message names the key."""


class InputError(Eagle3Error, ValueError):
    """A file or folder the user named cannot be used (missing, empty, malformed); the message names it."""


class MissingInputError(Eagle3Error, FileNotFoundError):
    """An input the user named is not there; the message names it and, where it can, what makes it."""


class OutputExistsError(Eagle3Error, FileExistsError):
    """An output path the user named holds something this command did not write; the message names it."""


class TrainError(Eagle3Error, RuntimeError):
    """Training cannot start or go on; the message names the setting, store or file."""


def is_user_error(err: BaseException) -> bool:
    """A project error, or an OS error on a named file (not found, no permission, a folder):
    what an entry point prints as one line. An OS error with no file named is a bug."""
    return isinstance(err, Eagle3Error) or (isinstance(err, OSError) and err.filename is not None)


def run_cli(stage: str, fn: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """``fn(*args, **kwargs)``, an entry point's body, and its exit status; on a user error
    (:func:`is_user_error`) the one line ``<stage>: error: <message>`` on stderr, and 2.
    Anything else propagates with its traceback."""
    try:
        return fn(*args, **kwargs)
    except (Eagle3Error, OSError) as err:
        if not is_user_error(err):
            raise
        print(f"{stage}: error: {err}", file=sys.stderr)
        return 2


__all__ = ["ConfigError", "Eagle3Error", "InputError", "MissingInputError", "OutputExistsError", "TrainError",
           "is_user_error", "run_cli"]
