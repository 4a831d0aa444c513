"""What a drafter is to the decode loop: it proposes draft trees and learns what was committed.

Every drafter subclasses ``Drafter`` and is made known with ``registry.register``: its class
attributes say which methods it provides and, for a draft head, which checkpoints it loads and how
``lyanna train`` fits it.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Sequence

import numpy as np

from ..engines.base import LeftTree, PendingOutput
from .tree import DraftTree

if TYPE_CHECKING:  # annotations only: engines sit below drafters, nothing here runs them
    from ..engines.base import TargetEngine
    from ..engines.loading import Target


class DraftsTogether(Protocol):
    """What drafts several generations' rounds in one call (a device head whose caches are rows
    of one tensor: ``drafters.device_rows.HeadRows``)."""

    def draft(self, requests: Sequence["DraftRequest"]) -> list[DraftTree]:
        """Each request's tree, in order, from one call for all of them."""
        ...


@dataclass
class DraftRequest:
    """A round's drafting that waits to run with the other generations' of a batch
    (``Drafter.request``): the loop yields it instead of drafting, whoever drives the loop runs
    the requests of one ``together`` in one call and sends each its tree. ``context``: the
    committed tokens, the root last; ``depth``: the deepest the tree may be; ``seconds``: the
    call's, set by whoever ran it (what the batch's step waited for; the budget weighs it)."""

    together: DraftsTogether
    drafter: "Drafter"
    context: np.ndarray
    depth: int
    seconds: float = field(default=0.0, kw_only=True)


def draft_together(requests: Sequence[DraftRequest]) -> list[DraftTree]:
    """The requests of one ``together`` drafted in one call, each told the call's seconds."""
    began = time.perf_counter()
    trees = requests[0].together.draft(requests)
    for r in requests:
        r.seconds = time.perf_counter() - began
    return trees


class Drafter(ABC):
    """Proposes draft trees; learns what was committed.

    Hidden rows (``hidden`` below) map a tap, a Hugging Face ``hidden_states`` index of the target
    (``k < num_layers``: the input of layer k; ``num_layers``: the final-norm output), to a float32
    array ``[n, hidden_size]``, one row per token in the order given.
    """

    # Methods this class provides: method name -> keyword settings of its constructor (on top of a
    # checkpoint's decode settings for a head).
    VARIANTS: ClassVar[dict[str, dict[str, Any]]] = {}
    # A draft head's checkpoint arch (``config.json``'s ``arch``); None for a model-free drafter,
    # which every ``Decoder`` gets for every target.
    ARCH: ClassVar[str | None] = None
    # A head's tensors besides its decoder layer, checked when a checkpoint loads.
    TENSORS: ClassVar[tuple[str, ...]] = ()
    # ``"module:Recipe"`` of the ``training.recipes.HeadRecipe`` that fits this head with
    # ``lyanna train`` (None: not trainable here). A string, so drafters never import training.
    TRAINING: ClassVar[str | None] = None

    taps: tuple[int, ...] = ()  # target hidden-state taps it consumes
    # Whether it never proposes anything (``ar``): every round a plain step, which the loop may
    # launch before it has read the round before (``DecodeState.ahead``).
    plain: ClassVar[bool] = False
    passes: int = 0  # draft-model forward passes so far (0 for a model-free drafter), for statistics

    @classmethod
    def build(cls, target: "Target", engine: "TargetEngine", checkpoint: Path | None = None) -> dict[str, "Drafter"]:
        """Every method of ``VARIANTS`` (name -> drafter). This default serves model-free drafters:
        one instance per variant from its settings. Heads override it to read ``checkpoint``."""
        return {name: cls(**settings) for name, settings in cls.VARIANTS.items()}

    @abstractmethod
    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        """A new generation: the prompt and its hidden rows (one per prompt token)."""

    @abstractmethod
    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        """A tree continuing ``context`` (prompt + committed tokens; the last one is the root; the
        loop grows this list afterwards, so keep a copy of what must outlive the call)."""

    @abstractmethod
    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        """Tokens just written to the target cache (root + accepted path) and their hidden rows
        (one per token)."""

    def fork(self) -> "Drafter | None":
        """The same drafter (weights, settings) with fresh per-generation state, so several
        generations can use its method at once (batching). None, the default: it cannot, and
        generations of its method take turns."""
        return None

    def skip(self) -> None:
        """Told when a round goes by without a proposal (a loaded batch where the budget keeps
        nothing): state kept from the last proposal must not be reused as is."""

    def propose_free(self, context: Sequence[int], max_depth: int) -> DraftTree:
        """A tree that costs no draft-model pass (model-free matches, rows left over from the
        last chain), proposed instead of ``propose`` on rounds when drafting waits because it
        did not pay: such a tree costs only its verification, which the budget weighs. The
        default has none, and the round is a ``skip``."""
        self.skip()
        return DraftTree.empty()


class BatchDrafter(Drafter):
    """A drafter whose rounds in a batch can draft together (``lyanna``'s heads): one hook the
    loop uses where a drafter has it."""

    def request(self, context: Sequence[int], max_depth: int) -> DraftRequest | None:
        """``propose`` as a ``DraftRequest``, to run in one call with the other generations' of a
        batch (None: this round proposes on its own)."""
        return None


class DeviceDrafter(Drafter):
    """A drafter whose trees can stay on the target's device (the lyanna and eagle heads on a
    ``DeviceEngine``): four hooks the loop uses where a drafter has them, so that a round waits
    for no copy between drafting and verifying, and the host reads one round while the device
    runs the next (a round that does not draft included). A drafter on the host needs none of this."""

    def propose_sized(self, context: Sequence[int], max_depth: int, nodes: int | None) -> DraftTree | LeftTree:
        """``propose``, with the size the budget fixes before drafting (``Budget.nodes_ahead``:
        its best ``nodes``; None: the drafter's own cut): a tree cut and left on the device
        (``engines.device.DeviceTree``) for the verification pass to read. The default
        proposes on the host, where the budget cuts the tree it sees."""
        return self.propose(context, max_depth)

    def propose_after(self, pending: PendingOutput, context: Sequence[int], max_depth: int,
                      nodes: int | None) -> LeftTree | None:
        """A tree for the round after one whose pass the host has not read yet (``pending``,
        verified on the device; ``context`` still ends at that round's root), drafted on the
        device from what that pass left there; ``max_depth`` and ``nodes`` as for
        ``propose_sized``. None, the default: the loop reads the pending round first."""
        return None

    @property
    def on_device(self) -> bool:
        """Whether its head runs on the target's device, taking a pass's rows there (``commit``
        then gets device tensors). False, the default: a head on the host."""
        return False

    def follow_plain(self, pending: PendingOutput, context: Sequence[int]) -> bool:
        """Whether a plain step may follow ``pending`` on the device before the host reads it, on
        a round that does not draft: True once the drafter took that round's kept rows there
        (the next pass overwrites them; ``settle`` counts them). False, the default, where the
        round would propose from the host (rows left over from the last chain, suffix matches)
        or the drafter cannot: the loop reads ``pending`` first."""
        return False

    def settle(self, tokens: Sequence[int]) -> None:
        """``commit`` of a round whose kept rows ``propose_after`` or ``follow_plain`` took on the
        device already: the host's count of them. Only a drafter that took them is told."""
        raise NotImplementedError(f"{type(self).__name__} drafts no round ahead, so it settles none")


def can_fork(drafter: Drafter) -> bool:
    """Whether ``drafter`` overrides ``fork`` (serves several generations at once)."""
    return type(drafter).fork is not Drafter.fork


def fork(drafter: Drafter) -> Drafter:
    """A drafter for one more generation: ``drafter.fork()`` where it has one, else ``drafter``
    itself, which can then serve only one generation at a time (``can_fork`` says which)."""
    return drafter.fork() or drafter


class NoDrafter(Drafter):
    """The drafter of ``ar``: it proposes nothing, so every round is one plain decoding step."""

    plain = True

    def fork(self) -> "NoDrafter":
        return self  # stateless

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        pass

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        return DraftTree.empty()

    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        pass
