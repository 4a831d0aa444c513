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


def prefer_full_vectors() -> None:
    """Let LLVM use the CPU's widest vectors. For AVX-512 CPUs LLVM prefers 256-bit vectors by
    default (a tuning flag, "prefer-256-bit"), which halves the multiply-adds per instruction of
    the kernels where they are bound by arithmetic, not memory (a layer's four fp32 matmuls of 8
    rows took about 1.35x as long with it on an AVX-512 Xeon). This sets numba's process-wide target
    features, read once when its code generator starts (the first ``cache=True`` decoration
    starts it), so it runs when the package is imported, before any module of kernels; a
    NUMBA_CPU_FEATURES the user set wins. Without AVX-512 the flag changes nothing. (Set from
    ``kernels``, it came after ``halves``' decorations on most import orders: the CLI, the server
    and the decoder compiled with the 256-bit preference, and a process that imported ``step``
    first without it, so neither could load the other's cached kernels.)"""
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    if config.CPU_FEATURES is None:
        host = get_host_cpu_features()
        config.CPU_FEATURES = f"{host},-prefer-256-bit" if host else "-prefer-256-bit"
