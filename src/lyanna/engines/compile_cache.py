"""Where numba caches the package's compiled kernels: a directory named by their sources' hash.

numba files a compiled function under its own source file's timestamp only. A kernel that calls
another module's kernel carries a compiled copy of it (``fused.py``'s layers call the attention
of ``kernels.py``; the draft head calls ``kernels.exp_nonpositive``), so after a ``git pull`` that
changes only the callee, the cached caller would keep running the old code: two paths of the
engine would compute different bits, and greedy speculative decoding would no longer be certain
to match ``ar``. Naming the cache directory by the hash of every module that compiles with
``cache=True`` or defines IR for such kernels (``numba.extending``) makes any change to them start
from a fresh cache (the first run after it
compiles for a minute). A ``NUMBA_CACHE_DIR`` the user set wins.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from ..paths import cache_dir

_PACKAGE = Path(__file__).resolve().parents[1]  # the whole lyanna package


def source_keyed_dir(base: Path, package: Path = _PACKAGE) -> Path:
    """``base/numba/<hash>``: the hash of ``package``'s modules that cache compiled code."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        text = path.read_bytes()
        # numba.extending: intrinsics and overloads, whose IR a cached kernel of another module
        # carries (``intdot_ir``'s block emitter inside ``intdot``'s kernels)
        if b"cache=True" in text or b"numba.extending" in text:
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + text)
    return base / "numba" / digest.hexdigest()[:16]


def use_source_keyed_cache() -> None:
    """Point numba's cache at ``source_keyed_dir(cache_dir())`` unless ``NUMBA_CACHE_DIR`` is set;
    must run before the first ``@njit(cache=True)`` of the package is decorated."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    where = str(source_keyed_dir(cache_dir()))
    os.environ["NUMBA_CACHE_DIR"] = where  # read when numba is imported, here and in child processes
    if "numba" in sys.modules:  # imported already: its config has read the environment
        from numba.core import config

        config.CACHE_DIR = where
