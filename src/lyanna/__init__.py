"""Lyanna: fast, lossless LLM decoding by hidden-state speculative decoding."""
__version__ = "0.1.0"
