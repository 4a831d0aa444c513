"""Data shipped inside the package, so a bare clone or an installed wheel needs no file beside it.

The benchmark questions (provenance and licenses in ``SOURCES.md`` here) are read through
``importlib.resources``, which also works when the package is installed as a zip or wheel.
"""
from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

SPEC_BENCH = "spec_bench_question.jsonl"
MT_BENCH = "mt_bench_question.jsonl"
BENCHMARK_FILES = (SPEC_BENCH, MT_BENCH)  # evaluation sets: never trained on


def packaged(name: str) -> Traversable:
    """The shipped data file ``name``."""
    return resources.files(__name__) / name
