"""Where Lyanna keeps what it makes on a user's machine: converted models, latency calibrations and
compiled kernels, under one directory."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$LYANNA_CACHE`` or ``~/.cache/lyanna``."""
    return Path(os.environ.get("LYANNA_CACHE") or Path.home() / ".cache" / "lyanna")
