"""What ``lyanna train`` must know of each head architecture, and nothing else does.

A trainable drafter names its recipe in ``TRAINING`` (``"module:Class"``); ``recipe_for(arch)``
resolves it. The fit and export stages are the same for every head; a recipe builds the torch
head to fit, adds what its checkpoint holds beyond the fitted parameters, and its model-card lines.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import numpy as np

from ..drafters.registry import head_class, trainable_archs
from ..engines.base import TargetEngine
from ..errors import LyannaError
from .run import fitted_taps, head_layers_of


class HeadRecipe:
    """The default recipe: an EAGLE-style head (``modules.EagleHead``), nothing beyond its
    parameters in the checkpoint."""

    # Checkpoint tensors that are made at export, not fitted (a continued fit does not load them).
    EXPORT_ONLY: tuple[str, ...] = ()

    def init_head(self, engine: TargetEngine, target_weights: dict[str, np.ndarray], d2t: np.ndarray,
                  settings: dict[str, Any], start: dict[str, np.ndarray] | None, seed: int):
        """The torch head to fit; ``d2t`` are the training data's most frequent target tokens,
        ``start`` a checkpoint's tensors to continue from (loaded afterwards by the caller; a
        recipe may take shapes from it and record them in ``settings``)."""
        from .fit import init_eagle_head

        if len(fitted_taps(settings, engine.config.num_layers)) > 1:  # its drafted rows feed its own predicted features back
            raise LyannaError(f"an eagle head reads one tap; these features hold {settings['taps']}")
        head = init_eagle_head(engine, target_weights, seed=seed, layers=head_layers_of(settings))
        head.restrict_loss_vocab(d2t)  # the same frequent tokens as Lyanna's draft vocabulary
        return head

    def export(self, weights: dict[str, np.ndarray], reply_counts: Callable[[], np.ndarray], hot: int) -> dict[str, Any]:
        """Add export-only tensors to ``weights`` (``reply_counts()``: how often the assistant
        wrote each token in the run's data); return what the config and card report of them."""
        return {}

    def card_lines(self, weights: dict[str, np.ndarray], settings: dict[str, Any], exported: dict[str, Any]) -> list[str]:
        """Model-card lines particular to this head (``exported``: what ``export`` returned)."""
        return []


class EagleRecipe(HeadRecipe):
    """``eagle``: the default recipe."""


class LyannaRecipe(HeadRecipe):
    """``lyanna``: a chain head with a draft vocabulary and a low-rank token-info table, whose
    most frequent reply tokens are materialized at export (``ti.hot``)."""

    EXPORT_ONLY = ("ti.hot",)

    def init_head(self, engine: TargetEngine, target_weights: dict[str, np.ndarray], d2t: np.ndarray,
                  settings: dict[str, Any], start: dict[str, np.ndarray] | None, seed: int):
        from .fit import init_lyanna_head

        if start is not None:  # the checkpoint's draft vocabulary and rank: its tables index them
            d2t = start["d2t"]
            settings.update(rank=int(start["ti.a"].shape[1]), draft_vocab=len(d2t))
        return init_lyanna_head(engine, target_weights, d2t, rank=settings["rank"], seed=seed,
                                taps=len(fitted_taps(settings, engine.config.num_layers)),
                                layers=head_layers_of(settings))

    def export(self, weights: dict[str, np.ndarray], reply_counts: Callable[[], np.ndarray], hot: int) -> dict[str, Any]:
        counts = reply_counts()
        total = max(counts.sum(), 1)
        hot_ids = np.argsort(-counts, kind="stable")[:hot]
        weights["ti.hot"] = hot_ids.astype(np.int64)
        return {"hot_tokens": hot, "hot_coverage": float(counts[hot_ids].sum() / total),
                "d2t_coverage": float(counts[weights["d2t"]].sum() / total)}

    def card_lines(self, weights: dict[str, np.ndarray], settings: dict[str, Any], exported: dict[str, Any]) -> list[str]:
        return [f"- draft vocabulary: {len(weights['d2t'])} tokens covering {exported['d2t_coverage']:.1%} of reply "
                f"tokens; token-info rank {settings['rank']}; materialized hot rows: {exported['hot_tokens']} "
                f"({exported['hot_coverage']:.1%} of reply tokens)"]


def recipe_for(arch: str) -> HeadRecipe:
    """The recipe the registered drafter of ``arch`` names."""
    cls = head_class(arch)
    if cls is None:
        raise LyannaError(f"unknown draft-head arch {arch!r}; known: {' or '.join(map(repr, trainable_archs()))}")
    if cls.TRAINING is None:
        raise LyannaError(f"the {arch} head has no training recipe: `lyanna train` cannot fit it")
    module, _, name = cls.TRAINING.partition(":")
    try:
        recipe = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise LyannaError(f"{cls.__name__}.TRAINING = {cls.TRAINING!r} does not name a recipe ({e})") from None
    return recipe()
