"""Where the project keeps caches: converted targets, downloaded wheels, data sets."""

from __future__ import annotations

import os
from pathlib import Path


def eagle3_home() -> Path:
    """``$EAGLE3_HOME``, default ``~/.cache/eagle3``."""
    return Path(os.environ.get("EAGLE3_HOME", Path.home() / ".cache" / "eagle3")).expanduser()
