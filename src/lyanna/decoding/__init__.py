"""Decoding: the one speculative loop, lossless verification, sampling, stopping, the tree budget,
continuous batching, the prefix cache, and the ``Decoder`` that maps method names onto them."""
from .decoder import Decoder, GenerationRequest, GenerationResult

__all__ = ["Decoder", "GenerationRequest", "GenerationResult"]
