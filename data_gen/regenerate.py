"""Stage CLI: ``python -m data_gen.regenerate`` (the work is :mod:`eagle3.regenerate`'s, which mining calls too)."""

from __future__ import annotations

import sys

from eagle3.regenerate import ManifestMismatchError, RegenerateError, main, part_path, read_pool, run

__all__ = ["ManifestMismatchError", "RegenerateError", "main", "part_path", "read_pool", "run"]

if __name__ == "__main__":
    sys.exit(main())
