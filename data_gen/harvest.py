"""Stage CLI: ``python -m data_gen.harvest`` (the work is :mod:`eagle3.harvest`'s, which mining calls too)."""

from __future__ import annotations

import sys

from eagle3.harvest import HarvestError, main, run, tokenize_records

__all__ = ["HarvestError", "main", "run", "tokenize_records"]

if __name__ == "__main__":
    sys.exit(main())
