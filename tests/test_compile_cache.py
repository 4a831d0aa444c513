"""numba's compiled kernels are cached under a directory named by the hash of their sources."""
from __future__ import annotations

import os
import subprocess
import sys

from lyanna.engines.compile_cache import source_keyed_dir


def test_the_directory_changes_with_any_compiled_module_and_only_with_them(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    kernel, callee, plain = package / "fused.py", package / "sub" / "kernels.py", package / "server.py"
    kernel.write_text("@njit(cache=True)\ndef f(): return g()\n")
    callee.write_text("@njit(cache=True)\ndef g(): return 1\n")
    plain.write_text("x = 1\n")
    first = source_keyed_dir(tmp_path / "cache", package)
    assert first.parent == tmp_path / "cache" / "numba"
    plain.write_text("x = 2\n")  # compiles nothing: the cache stays
    assert source_keyed_dir(tmp_path / "cache", package) == first
    callee.write_text("@njit(cache=True)\ndef g(): return 2\n")  # the callee alone changed: f's copy is stale
    second = source_keyed_dir(tmp_path / "cache", package)
    assert second != first
    callee.rename(package / "kernels2.py")  # same text under another name is another module
    third = source_keyed_dir(tmp_path / "cache", package)
    assert third not in (first, second)
    # IR spliced into a cached kernel from a module that caches nothing itself is that kernel's code too
    emitter = package / "emitter.py"
    emitter.write_text("from numba.extending import intrinsic\n")
    fourth = source_keyed_dir(tmp_path / "cache", package)
    assert fourth != third
    emitter.write_text("from numba.extending import intrinsic\n# the emitted IR changed\n")
    assert source_keyed_dir(tmp_path / "cache", package) != fourth


def _numba_cache_dir(env: dict[str, str]) -> str:
    code = "import lyanna; from numba.core import config; print(config.CACHE_DIR)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_importing_lyanna_points_numba_there_unless_the_user_chose(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["LYANNA_CACHE"] = str(tmp_path)
    assert _numba_cache_dir(env) == str(source_keyed_dir(tmp_path))
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    assert _numba_cache_dir(env) == str(tmp_path / "mine")


_SILU_AFTER = """
import sys
import numpy as np
from numba import njit
from lyanna.engines import kernels

@njit(fastmath={"reassoc", "contract", "nsz", "arcp"})
def fast_softmax_sum(x):  # as the draft tree's softmax calls it
    total = np.float32(0.0)
    for v in x:
        total += kernels.exp_nonpositive(v)
    return total

if sys.argv[1] == "fastmath-caller-first":
    fast_softmax_sum(-np.abs(np.arange(64, dtype=np.float32)))
gate_up = (np.random.default_rng(0).standard_normal((8, 512)) * 4).astype(np.float32)
print(kernels.silu_mul(gate_up).view(np.int32).tobytes().hex())
"""


def test_the_targets_silu_has_the_same_bits_whichever_caller_compiled_its_exp_first(tmp_path):
    """numba compiles a shared function that leaves ``fastmath`` unset with its first caller's
    flags and hands that copy to every later caller (and to later processes, from its cache):
    ``exp_nonpositive`` states it, so the target's SiLU gets the same bits in a process (with a
    cache of its own) that compiled a fastmath softmax over it first."""
    outputs = []
    for order in ("fastmath-caller-first", "silu-first"):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / order))
        run = subprocess.run([sys.executable, "-c", _SILU_AFTER, order], env=env, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs.append(run.stdout.split()[-1])
    assert outputs[0] == outputs[1]
