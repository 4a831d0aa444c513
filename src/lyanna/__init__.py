"""Lyanna: fast, lossless LLM decoding by hidden-state speculative decoding."""
from .engines.compile_cache import prefer_full_vectors as _prefer_full_vectors
from .engines.compile_cache import use_source_keyed_cache as _use_source_keyed_cache

__version__ = "0.1.0"
_use_source_keyed_cache()  # before any kernel is compiled: see compile_cache.py
_prefer_full_vectors()  # before numba's code generator starts: see there
