"""The one decode loop every method runs through, ``ar`` included (its drafter proposes nothing).

A round: the drafter proposes a tree that continues the committed context (whose last token,
the root, is not in the target's cache yet); the target runs root + tree in one pass; the
verifier picks the accepted path and the bonus token (a tree left on the target's device is
verified in the pass, by the same rules); the output tracker commits them (cutting
at EOS, stop strings, ``max_new_tokens``); the target cache keeps only root + accepted path; and
the drafter is told what was committed, with the target hidden states it asked for. With an empty
tree a round is exactly one autoregressive step.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generator, TypeVar

import numpy as np

from ..drafters.base import BatchDrafter, DeviceDrafter, Drafter, DraftRequest, draft_together
from ..drafters.tree import DraftTree
from ..engines.base import (Block, Cache, ForwardOutput, LeftTree, PendingOutput, TargetEngine, Verification, first_runs,
                            shapes_compile)
from .budget import Budget
from .policy import Fallback, Plan, Policy
from .sampling import SamplingParams, next_token
from .stopping import OutputTracker
from .verify import Verdict, followed, verify

T = TypeVar("T")


@dataclass
class DecodeState:
    """What the loop works on: the cache holds the prompt and every committed token but the one
    to be chosen next from ``last_logits`` (the target's logits after the cached context)."""

    engine: TargetEngine
    cache: Cache
    tracker: OutputTracker
    params: SamplingParams
    rng: np.random.Generator
    prompt_ids: list[int]
    last_logits: np.ndarray  # target logits after the cached context
    prefill_hidden: dict[int, np.ndarray] = field(default_factory=dict)  # taps over the prompt
    target_passes: int = 0
    # Whether a pass that verifies a tree left on the device may return before its outcome is
    # read (``Block.ahead``): the engine keeps one (``engines.device.DeviceEngine.pipelines``).
    ahead: bool = False
    # Whether rounds ask their drafting of whoever drives the loop (``DraftRequest``), so that a
    # batch's drafters run in one call where they can (in a batch).
    together: bool = False


@dataclass
class RoundStats:
    """What the rounds of one generation did: draft tokens verified and committed, acceptance
    by depth, and where the time went."""

    draft_tokens: int = 0  # draft nodes sent to verification
    accepted_draft_tokens: int = 0  # of those, committed
    recovered_tokens: int = 0  # committed nodes that came from re-sampling an earlier chain
    draft_passes: int = 0
    first_runs: int = 0  # calls of a shape run for the first time (a compile and a capture on a GPU)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    tried_by_depth: Counter[int] = field(default_factory=Counter)
    accepted_by_depth: Counter[int] = field(default_factory=Counter)
    fell_back_after_tokens: int | None = None  # tokens committed when the fallback first paused drafting
    fallback_pauses: int = 0
    # Per number of draft nodes verified in a round (0: a plain round): [rounds, tokens committed,
    # seconds]. How often a method drafted and what its rounds of each size earned, which totals
    # hide: a budget that waits too long or keeps trees too large shows here, not in tau.
    by_size: dict[int, list[float]] = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        """Rounds read so far (each counted once in ``by_size``)."""
        return int(sum(cell[0] for cell in self.by_size.values()))

    def timed(self, nodes: int, committed: int, seconds: float) -> None:
        """One round's size, committed tokens and seconds (``by_size``)."""
        cell = self.by_size.setdefault(nodes, [0, 0, 0.0])
        cell[0] += 1
        cell[1] += committed
        cell[2] += seconds

    def record(self, tree: DraftTree, verdict: Verdict, committed_drafts: int) -> None:
        if not len(tree):  # nothing was drafted (always, for ar): nothing else to count
            return
        path = verdict.path
        self.draft_tokens += len(tree)
        self.accepted_draft_tokens += committed_drafts
        if committed_drafts:
            self.recovered_tokens += int(tree.origin[path[:committed_drafts]].sum())
        kids = tree.children()  # a node's children are one level below it
        for d, node in enumerate([-1] + path, start=1):
            if node in kids:
                self.tried_by_depth[d] += 1
                self.accepted_by_depth[d] += d <= len(path)

    def to_extra(self) -> dict[str, Any]:
        """The ``GenerationResult.extra`` entries."""
        fell_back = ({} if self.fell_back_after_tokens is None else
                     {"fell_back_after_tokens": self.fell_back_after_tokens, "fallback_pauses": self.fallback_pauses})
        return {
            **fell_back,
            "rounds": self.rounds,
            "draft_passes": self.draft_passes,
            "first_runs": self.first_runs,
            "recovered_tokens": self.recovered_tokens,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "accepted_by_depth": {d: [self.accepted_by_depth[d], self.tried_by_depth[d]] for d in sorted(self.tried_by_depth)},
            "rounds_by_size": {n: list(self.by_size[n]) for n in sorted(self.by_size)},
        }


def _block(tree: DraftTree, root: int, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Tokens, positions and mask of root + tree as one verification block (no mask for the root
    alone: the plain decoding step, kept as cheap as a hand-written one)."""
    if not len(tree):
        return np.array([root]), np.array([start]), None
    n = len(tree) + 1
    mask = np.zeros((n, n), bool)
    mask[:, 0] = True
    mask[1:, 1:] = tree.ancestor_mask()
    tokens = np.concatenate([[root], tree.tokens])
    positions = np.concatenate([[start], tree.positions(start + 1)])
    return tokens, positions, mask


# Yields blocks to run and drafting to do (``DraftRequest``), is sent their outputs and trees.
Forwards = Generator[Block | DraftRequest, ForwardOutput | DraftTree, "RoundStats"]


def run_alone(steps: Generator[Block | DraftRequest, ForwardOutput | DraftTree, T], engine: TargetEngine) -> T:
    """Drive a generation that yields forward blocks on ``engine``, one block per pass, and
    drafting requests, each alone (the batch scheduler drives many of them together instead,
    with ``forward_batch`` and one drafting call per group)."""
    try:
        item = next(steps)
        while True:
            if isinstance(item, DraftRequest):
                item = steps.send(draft_together([item])[0])
            else:
                item = steps.send(engine.forward_batch([item])[0])
    except StopIteration as done:
        return done.value


def decode(state: DecodeState, drafter: Drafter, budget: Budget | None = None,
           fallback: Fallback | None = None) -> RoundStats:
    """Generate until the tracker finishes, alone on the engine (see ``rounds``)."""
    return run_alone(rounds(state, drafter, budget, fallback), state.engine)


@dataclass
class Round:
    """A round on its way: its tree (a tree left on the device until the pass brings it back),
    its plan's ``drafting``, whether the fallback judges it (a drafted tree, even one the budget
    cut to nothing; None: known once a tree left on the device is back), its block's start, its
    times so far (drafting began, the pass was launched, the launch returned) and the pass's
    output (a pending one for a block launched ``ahead``); ``met``: the engine's ``first_runs``
    when it began (grown by the time it is read: its times are a compile's, not a measure)."""

    tree: DraftTree | LeftTree
    drafting: bool
    proposed: bool | None
    start: int
    t0: float
    t1: float
    t2: float
    out: ForwardOutput | PendingOutput
    met: int


@dataclass
class _Reading:
    """A round's outcome as ``Rounds.read`` works through it: the tree (on the host now), the
    pass's output, the verdict, and the drafting and verification seconds it counts."""

    tree: DraftTree
    out: ForwardOutput
    verdict: Verdict
    drafted: float
    t_pass: float
    measured: bool  # no shape ran for the first time during the round (``Round.met``)


def _verification(state: DecodeState, nodes: int) -> Verification:
    """The rule a pass verifies a tree of ``nodes`` left on the device by (none: a plain step):
    random numbers drawn here, one a node and the bonus token's."""
    params = state.params
    uniforms = None if params.greedy else state.rng.random(nodes + 1)
    return Verification(params.temperature, params.top_p, params.top_k, uniforms)


class Rounds:
    """One generation's rounds, in phases: ``plan`` (what the drafting policy allows), ``draft``
    (the drafter's tree, cut by the policy), ``launch`` (the block the target runs) and ``read``
    (verdict, commit, what the policy learns). Two drivers run them:
    ``synchronous`` reads each round before the next; ``pipelined`` (engines that keep a pass
    ``ahead``) drafts and launches round n on the device from round n-1's outcome there, and
    reads round n-1 while round n runs. Both are generators that yield blocks and are sent the
    target's outputs, so one loop serves a sequence alone and inside a batch."""

    def __init__(self, state: DecodeState, drafter: Drafter, policy: Policy):
        self.state, self.drafter, self.policy = state, drafter, policy
        self.stats = RoundStats()
        drafter.start(state.prompt_ids, state.prefill_hidden)
        self._passes_before, self._first_runs_before = drafter.passes, first_runs(state.engine)
        self.root = next_token(state.last_logits, state.params, state.rng)
        state.tracker.extend([self.root])
        self.context = [*state.prompt_ids, self.root]  # prompt + committed tokens, grown in place
        self.read_at = time.perf_counter()  # when the host last read a round's outcome

    # -- phases --------------------------------------------------------------------------------

    def plan(self, drafting: bool) -> Plan:
        """This round's ``Plan`` from the context as it stands and the gate's answer."""
        return self.policy.plan(drafting, self._room())

    def _room(self) -> int:
        """Tokens the reply may still take after this round's bonus token."""
        return self.state.tracker.max_new_tokens - len(self.state.tracker.tokens) - 1

    def draft(self, plan: Plan, t0: float,
              met: int) -> Generator[DraftRequest, DraftTree, tuple[DraftTree | LeftTree, bool | None]]:
        """The round's tree and whether the fallback judges it (None: a tree left on the device,
        cut to a size fixed before drafting, is known after the pass); ``met``: the engine's
        ``first_runs`` when drafting began. Drafting asked of the driver (``DecodeState.
        together``) is yielded as a ``DraftRequest`` and sent back as the tree."""
        drafter = self.drafter
        request = None
        if plan.drafting and self.state.together and isinstance(drafter, BatchDrafter):
            request = drafter.request(self.context, plan.depth)
        if request is not None:
            asked = time.perf_counter()
            tree = yield request
            t0 += time.perf_counter() - asked - request.seconds  # the others' rounds before the call are not drafting
        elif plan.drafting:  # a size fixed now lets a drafter on the target's device leave its tree there
            if not plan.seen and isinstance(drafter, DeviceDrafter):
                tree = drafter.propose_sized(self.context, plan.depth, plan.nodes)
            else:
                tree = drafter.propose(self.context, plan.depth)
        elif plan.free:  # drafting waits: only what costs no draft pass, if it pays
            tree = drafter.propose_free(self.context, plan.depth)
        else:  # paused by the fallback with every tree verified whole, or requests wait for the batch
            drafter.skip()
            tree = DraftTree.empty()
        if not isinstance(tree, DraftTree):
            return tree, None
        tree = tree.prune_depth(plan.depth)
        proposed = plan.drafting and len(tree) > 0  # judged by the fallback even when the budget keeps nothing
        measured = first_runs(self.state.engine) == met
        return self.policy.cut(tree, time.perf_counter() - t0, not plan.drafting, measured), proposed

    def launch(self, tree: DraftTree | LeftTree, start: int) -> Block:
        """The block that verifies root + ``tree`` from ``start``: a tree left on the device is
        verified in its pass (returned pending where the engine keeps passes ahead), as is a plain
        step there (so the next can follow it; a head on the device takes its rows there); a host
        tree is a block with its ancestor mask."""
        state, drafter = self.state, self.drafter
        if not isinstance(tree, DraftTree):
            return Block([self.root], [start], state.cache, taps=drafter.taps, tree=tree,
                         verification=_verification(state, tree.nodes), ahead=state.ahead)
        plain = drafter.plain or (not len(tree) and isinstance(drafter, DeviceDrafter) and drafter.on_device)
        if plain and state.ahead:
            return Block([self.root], [start], state.cache, taps=drafter.taps, verification=_verification(state, 0),
                         ahead=True)
        tokens, positions, mask = _block(tree, self.root, start)
        return Block(tokens, positions, state.cache, mask, taps=drafter.taps)

    def launch_after(self, pending: Round, plan: Plan) -> DraftTree | LeftTree | None:
        """A tree that continues ``pending``'s outcome on the device, before the host reads it
        (an empty one: a plain step; None: the drafter cannot: read ``pending`` first)."""
        depth = min(plan.depth, self._room() - (pending.out.levels + 1))  # if it keeps every level
        drafter = self.drafter
        if drafter.plain:  # a plain step follows as it is
            return DraftTree.empty()
        if not isinstance(drafter, DeviceDrafter):
            return None
        if plan.drafting and depth >= 1 and not plan.seen:
            return drafter.propose_after(pending.out, self.context, depth, plan.nodes)
        if not plan.drafting and drafter.follow_plain(pending.out, self.context):  # as ``ar``'s step does
            return DraftTree.empty()
        return None

    def launch_following(self, tree: DraftTree | LeftTree, pending: Round) -> Block:
        """The block of ``launch_after``'s tree (an empty one: a plain step), verified in its pass
        on the device after ``pending``'s, whose bonus token is its root."""
        left = None if isinstance(tree, DraftTree) else tree
        return Block((), (), self.state.cache, taps=self.drafter.taps, tree=left,
                     verification=_verification(self.state, 0 if left is None else left.nodes), ahead=True,
                     follows=pending.out)

    def read(self, r: Round, handed_over: bool) -> None:
        """Read round ``r``'s outcome: verdict, commit, what the budget and fallback learn.
        ``handed_over``: the drafter took its kept rows on the device already (``settle``)."""
        began = time.perf_counter()
        got = self._outcome(r)
        tree, out, verdict = got.tree, got.out, got.verdict
        tracker = self.state.tracker
        taken = tracker.extend(verdict.tokens)
        self.context.extend(verdict.tokens[:taken])
        keep = [0] + [1 + i for i in verdict.path]
        if not out.verified and len(tree):  # drop the rejected nodes (a lone root has none; a device tree's pass did)
            self.state.cache.compact(r.start, keep)
        t2 = time.perf_counter()
        self.stats.record(tree, verdict, min(len(verdict.path), taken))
        if not tracker.finished:
            tokens = np.concatenate([[self.root], tree.tokens])[keep].tolist()
            if handed_over:  # a plain drafter has nothing to settle
                if isinstance(self.drafter, DeviceDrafter):
                    self.drafter.settle(tokens)
            else:
                hidden = out.hidden if out.verified else {k: v[keep] for k, v in out.hidden.items()}
                self.drafter.commit(tokens, hidden)
            self.root = verdict.tokens[-1]
        # A round launched ahead took, as far as the host can tell, the time since the last read.
        now = time.perf_counter()
        timed = isinstance(r.out, ForwardOutput)  # this round's own times (not one launched ahead)
        seconds = now - r.t0 if timed else now - self.read_at
        proposed = r.drafting and len(tree) > 0 if r.proposed is None else r.proposed
        self.stats.timed(len(tree), taken, seconds)
        if self.policy.observe(tree, len(verdict.path), got.t_pass, proposed, seconds, taken,
                              measured=got.measured, drafted=got.drafted if timed else None):
            if self.stats.fell_back_after_tokens is None:
                self.stats.fell_back_after_tokens = len(tracker.tokens)
            self.stats.fallback_pauses += 1
        t3 = time.perf_counter()
        self.stats.draft_seconds += got.drafted
        self.stats.verify_seconds += got.t_pass + (t2 - began)
        self.stats.other_seconds += t3 - t2
        self.read_at = t3

    def _outcome(self, r: Round) -> _Reading:
        """``r``'s pass waited for (a pending one collected), its tree on the host (a tree left on
        the device is weighed by the budget now), its verdict (the pass's own where it verified),
        and the seconds drafting and verification took, the device's own where it keeps them."""
        tree, out = r.tree, r.out
        on_device = not isinstance(tree, DraftTree)
        measured = first_runs(self.state.engine) == r.met
        drafted, t_pass = r.t1 - r.t0, r.t2 - r.t1  # the host's times
        if isinstance(out, ForwardOutput):  # the pass that read a tree left on the device also waited for the draft
            waited = min(tree.device_seconds(), t_pass) if on_device else 0.0
            drafted, t_pass = drafted + waited, t_pass - waited
        else:  # launched ahead: wait for it now; the device's own times where it keeps them
            out, pending = out.collect(), out
            drafted, t_pass = (on_device and tree.device_seconds()) or drafted, pending.device_seconds() or t_pass
        if on_device:  # the tree came back with the pass
            tree = DraftTree.from_packed(out.tree)
            self.policy.sized(tree, drafted, measured)
        self.state.target_passes += 1
        if not out.verified:
            verdict = verify(tree, out.logits, self.state.params, self.state.rng)
        else:  # verified where it ran, the cache compacted there
            verdict = followed(tree, out.kept, out.bonus)
        return _Reading(tree, out, verdict, drafted, t_pass, measured)

    def _round(self, plan: Plan,
               t0: float) -> Generator[Block | DraftRequest, ForwardOutput | PendingOutput | DraftTree, Round]:
        """Draft and launch one round from the committed context."""
        met = first_runs(self.state.engine)
        tree, proposed = yield from self.draft(plan, t0, met)
        t1, start = time.perf_counter(), self.state.cache.length
        out = yield self.launch(tree, start)
        return Round(tree, plan.drafting, proposed, start, t0, t1, time.perf_counter(), out, met)

    def _done(self) -> RoundStats:
        self.stats.draft_passes = self.drafter.passes - self._passes_before
        self.stats.first_runs = first_runs(self.state.engine) - self._first_runs_before
        return self.stats

    # -- drivers -------------------------------------------------------------------------------

    def synchronous(self) -> Forwards:
        """Each round drafted, launched and read before the next."""
        while not self.state.tracker.finished:
            t0 = time.perf_counter()
            r = yield from self._round(self.plan(self.policy.gate()), t0)
            self.read(r, handed_over=False)
        return self._done()

    def pipelined(self) -> Forwards:
        """Rounds launched ahead where they can be: while round n-1's outcome is on the device,
        round n is drafted and launched from it there (the budget and fallback decide from what
        they knew a round earlier), then round n-1 is read while round n runs; where round n
        cannot follow that way, round n-1 is read first and round n starts from the host."""
        pending: Round | None = None  # a round launched ahead whose outcome is still on the device
        while not self.state.tracker.finished:
            t0, met = time.perf_counter(), first_runs(self.state.engine)
            drafting = self.policy.gate()
            if pending is not None:
                tree = self.launch_after(pending, self.plan(drafting))
                if tree is not None:
                    t1 = time.perf_counter()
                    out = yield self.launch_following(tree, pending)
                    on_device = not isinstance(tree, DraftTree)  # its size known after the pass
                    launched = Round(tree, drafting, None if on_device else False, -1, t0, t1, time.perf_counter(), out, met)
                    self.read(pending, handed_over=True)  # while the device runs the round just launched
                    pending = launched
                    continue
                self.read(pending, handed_over=False)  # read it first; this round starts from its outcome
                pending = None
                if self.state.tracker.finished:
                    break
            r = yield from self._round(self.plan(drafting), t0)  # planned from the context as read
            if isinstance(r.out, ForwardOutput):
                self.read(r, handed_over=False)
            else:  # left on the device: the next round may start from it there
                pending = r
        return self._done()


def rounds(state: DecodeState, drafter: Drafter, budget: Budget | None = None,
           fallback: Fallback | None = None) -> Forwards:
    """The decode loop (``Rounds``), as a generator that yields each round's verification block
    and is sent the target's output for it. ``budget`` trims each proposed tree (None: verify it
    whole); ``fallback`` pauses drafting while it does not pay; while either makes drafting
    wait, a budget still weighs the drafter's free tree (``Drafter.propose_free``). The drafter
    is told every commit, paused or not, so it can draft again at any round. Where the state
    allows it (``DecodeState.ahead``) rounds are pipelined (``Rounds.pipelined``). Returns the
    rounds' statistics."""
    loop = Rounds(state, drafter, Policy(budget, fallback, fixed_shapes=shapes_compile(state.engine)))
    return (yield from (loop.pipelined() if state.ahead else loop.synchronous()))
