"""Continuous batching: the generations in flight share every target forward pass.

Each generation is the decoder's generator of forward blocks (``Decoder.steps``: the prefill,
then one verification block per round of the one decode loop). A step gathers the pending block
of every active generation, runs them as one ragged forward (the linear layers stream their
weights once for all rows, which is what a CPU is short of) and sends each generation its own
output. Rounds that ask for their drafting (``DraftRequest``: a ``lyanna`` head's) are drafted
first, in one call per head. Generations join between steps and leave when they finish, so a new
request waits for one step, not for the batch. The kernels compute a row the same way whatever
shares its block, so a sequence's output inside a batch is token-identical to decoding it alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Hashable

from ..drafters.base import Drafter, DraftRequest, can_fork, draft_together
from ..drafters.tree import DraftTree
from ..engines.base import Block, ForwardOutput, TargetEngine
from .budget import Load

# A generation: yields blocks and drafting requests, is sent their outputs and trees, returns its result.
Steps = Generator[Block | DraftRequest, ForwardOutput | DraftTree, Any]


@dataclass
class _Flight:
    steps: Steps
    block: Block | DraftRequest
    method: str
    rows: int = 1  # rows of its last block (its drafting asked for: the block before)


class BatchScheduler:
    """The generations in flight, at most ``max_batch`` of them, stepped together on ``engine``;
    ``drafter_for(method)`` names a method's drafter (to know whether it can serve several at once)."""

    def __init__(self, engine: TargetEngine, drafter_for: Callable[[str], Drafter], max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.drafter_for, self.max_batch = engine, drafter_for, max_batch
        self.active: dict[Hashable, _Flight] = {}
        # The last step's forward pass: its seconds (the rest of a step: its rounds' host work) and rows;
        # its drafting calls shared by several rounds (``DraftRequest``): their seconds and rounds.
        self.pass_seconds, self.pass_rows = 0.0, 0
        self.draft_seconds, self.drafted = 0.0, 0
        # Requests queued for a place in the batch, as whoever feeds it counts them (an auto budget
        # drafts nothing while any wait: ``Budget.throughput_bound``).
        self.waiting = 0

    def can_admit(self, method: str) -> bool:
        """Room in the batch, and a drafter free for ``method`` (one without ``fork`` keeps its
        state on itself, so it serves one generation at a time)."""
        if len(self.active) >= self.max_batch:
            return False
        return can_fork(self.drafter_for(method)) or all(f.method != method for f in self.active.values())

    def load_for(self, key: Hashable) -> Callable[[], Load]:
        """For ``key``'s tree budget: how many other generations share the next pass, how many
        rows their blocks hold (those that chose already this step, else their last block), and
        how many requests wait."""
        def load() -> Load:
            others = [f for k, f in self.active.items() if k != key]
            return Load(len(others), sum(f.rows for f in others), self.waiting)
        return load

    def admit(self, key: Hashable, steps: Steps, method: str) -> None:
        """Add a generation (from ``Decoder.steps``); its prefill runs with the next step."""
        if key in self.active:
            raise ValueError(f"generation {key!r} is already in flight")
        block = next(steps)
        self.active[key] = _Flight(steps, block, method, block.rows if isinstance(block, Block) else 1)

    def _draft(self) -> list[tuple[Hashable, Any]]:
        """The drafting the generations in flight ask for, one call per group; returns those that
        finished meanwhile (a failed call's, with the exception that ended them)."""
        groups: dict[int, list[Hashable]] = {}
        for key, flight in self.active.items():
            if isinstance(flight.block, DraftRequest):
                groups.setdefault(id(flight.block.together), []).append(key)
        outcomes: dict[Hashable, ForwardOutput | DraftTree | Exception] = {}
        began = time.perf_counter()
        for keys in groups.values():
            requests = [self.active[k].block for k in keys]
            try:
                outcomes.update(zip(keys, draft_together(requests)))
            except Exception as e:  # the call's failure ends its generations; the batch goes on
                outcomes.update((k, e) for k in keys)
        self.draft_seconds, self.drafted = time.perf_counter() - began, len(outcomes)
        return self._send(outcomes)

    def _send(self, outcomes: dict[Hashable, ForwardOutput | DraftTree | Exception]) -> list[tuple[Hashable, Any]]:
        """Send each generation its outcome (an exception is thrown into it); returns those that
        finished, with their result or the exception that ended them."""
        finished: list[tuple[Hashable, Any]] = []
        for key, out in outcomes.items():
            flight = self.active[key]
            try:
                flight.block = flight.steps.throw(out) if isinstance(out, Exception) else flight.steps.send(out)
            except StopIteration as done:
                finished.append((key, done.value))
            except Exception as e:  # this generation's failure; the batch goes on
                finished.append((key, e))
            else:
                if isinstance(flight.block, Block):
                    flight.rows = flight.block.rows
                continue
            del self.active[key]
        return finished

    def step(self) -> list[tuple[Hashable, Any]]:
        """One forward pass for every generation in flight (their drafting first, where they ask
        for it); returns those that finished, with their result or the exception that ended them
        (the others go on)."""
        finished = self._draft()
        keys = list(self.active)
        if not keys:
            self.pass_seconds, self.pass_rows = 0.0, 0
            return finished
        blocks = [self.active[k].block for k in keys]
        self.pass_rows = sum(b.rows for b in blocks)
        began = time.perf_counter()
        try:
            outs: list[ForwardOutput | Exception] = list(self.engine.forward_batch(blocks))
        except ValueError:
            # A block the engine refuses (checked before anything runs): find whose, alone.
            outs = []
            for block in blocks:
                try:
                    outs.append(self.engine.forward_batch([block])[0])
                except ValueError as e:
                    outs.append(e)
        self.pass_seconds = time.perf_counter() - began
        return finished + self._send(dict(zip(keys, outs)))
