"""The one base of every user error the project raises.

A user error is bad input, settings or files: its message names the key, file or line, and every
entry point prints it as one line (``<stage>: error: <message>``) and exits 2, with no traceback.
Each stage's own class (``TrainError``, ``StoreError``, ...) derives from :class:`Eagle3Error`
and keeps the builtin base callers already catch (``ValueError`` or ``RuntimeError``).
"""

from __future__ import annotations


class Eagle3Error(Exception):
    """Bad input or settings, named in the message."""


class TrainError(Eagle3Error, RuntimeError):
    """Training cannot start or go on; the message names the setting, store or file."""


USER_ERRORS: tuple[type[Exception], ...] = (Eagle3Error, ValueError, OSError)
"""What an entry point prints as one line: the project's user errors, and the builtin errors of
reading files and values (torch, transformers and json raise these with the file or value named)."""

__all__ = ["USER_ERRORS", "Eagle3Error", "TrainError"]
