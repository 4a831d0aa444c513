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
from typing import Any, Callable, Generator, TypeVar

import numpy as np

from ..drafters.base import Drafter
from ..drafters.tree import DraftTree
from ..engines.base import Block, Cache, ForwardOutput, TargetEngine, Verification
from .budget import Budget
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


@dataclass
class RoundStats:
    """What the rounds of one generation did: draft tokens verified and committed, acceptance
    by depth, and where the time went."""

    rounds: int = 0
    draft_tokens: int = 0  # draft nodes sent to verification
    accepted_draft_tokens: int = 0  # of those, committed
    recovered_tokens: int = 0  # committed nodes that came from re-sampling an earlier chain
    draft_passes: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    tried_by_depth: Counter[int] = field(default_factory=Counter)
    accepted_by_depth: Counter[int] = field(default_factory=Counter)
    fell_back_after_tokens: int | None = None  # tokens committed when the fallback first paused drafting
    fallback_pauses: int = 0

    def record(self, tree: DraftTree, verdict: Verdict, committed_drafts: int) -> None:
        self.rounds += 1
        if not len(tree):  # nothing was drafted (always, for ar): nothing else to count
            return
        self.draft_tokens += len(tree)
        self.accepted_draft_tokens += committed_drafts
        self.recovered_tokens += int(tree.origin[verdict.path[:committed_drafts]].sum())
        depths = tree.depths
        kids = tree.children()
        for d, node in enumerate([-1] + verdict.path, start=1):
            if any(depths[c] == d for c in kids.get(node, [])):
                self.tried_by_depth[d] += 1
                self.accepted_by_depth[d] += d <= len(verdict.path)

    def to_extra(self) -> dict[str, Any]:
        """The ``GenerationResult.extra`` entries."""
        fell_back = ({} if self.fell_back_after_tokens is None else
                     {"fell_back_after_tokens": self.fell_back_after_tokens, "fallback_pauses": self.fallback_pauses})
        return {
            **fell_back,
            "rounds": self.rounds,
            "draft_passes": self.draft_passes,
            "recovered_tokens": self.recovered_tokens,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "accepted_by_depth": {d: [self.accepted_by_depth[d], self.tried_by_depth[d]] for d in sorted(self.tried_by_depth)},
        }


FALLBACK_WARMUP_ROUNDS = 8  # drafting rounds judged before the fallback may first pause drafting
# After a pause, a few drafting rounds judge whether drafting pays again: enough that one lucky or
# unlucky round does not decide, few enough that a probe of a drafter that never pays costs little.
PROBE_ROUNDS = 4
# Plain rounds of the first pause, doubled after each probe that does not pay (up to the last):
# text that turns repetitive (a summary quoting its source) is found again within a few dozen
# tokens, while a drafter that never pays probes ever more rarely.
FIRST_PAUSE_ROUNDS = 16
MAX_PAUSE_ROUNDS = 256


class Fallback:
    """Pauses drafting while it does not pay, and probes again later.

    Drafting rounds are judged in stretches (``FALLBACK_WARMUP_ROUNDS`` at first, ``PROBE_ROUNDS``
    after a pause): a stretch whose rounds committed tokens more slowly than plain decoding would
    (tokens times the one-token latency against their measured seconds) starts a pause of plain
    rounds, each longer than the last; a stretch that paid keeps drafting, judged afresh. Rounds
    where the drafter proposed nothing are plain decoding already and are not judged (so ``ar``
    never needs the latency curve)."""

    def __init__(self, step_seconds: Callable[[], float], warmup_rounds: int = FALLBACK_WARMUP_ROUNDS,
                 probe_rounds: int = PROBE_ROUNDS, first_pause: int = FIRST_PAUSE_ROUNDS,
                 max_pause: int = MAX_PAUSE_ROUNDS):
        """``step_seconds``: the target's one-token latency, asked for only when first needed."""
        self._step_seconds = step_seconds
        self.warmup_rounds, self.probe_rounds = warmup_rounds, probe_rounds
        self.first_pause, self.max_pause = first_pause, max_pause
        self._stretch = warmup_rounds  # drafting rounds in the stretch being judged
        self._rounds, self._seconds, self._tokens = 0, 0.0, 0
        self._next_pause = first_pause
        self._pause_left = 0
        self.pauses = 0  # pauses started so far

    def wants_drafts(self) -> bool:
        """Whether this round may draft (False while a pause lasts; each call is one round)."""
        if self._pause_left:
            self._pause_left -= 1
            return False
        return True

    def keep_drafting(self, seconds: float, tokens: int) -> bool:
        """Account one drafting round (its seconds, the tokens it committed); False when it ends a
        stretch that did not pay, which starts a pause."""
        self._rounds += 1
        self._seconds += seconds
        self._tokens += tokens
        if self._rounds < self._stretch:
            return True
        paid = self._tokens * self._step_seconds() >= self._seconds
        self._rounds, self._seconds, self._tokens = 0, 0.0, 0
        if paid:
            self._stretch, self._next_pause = self.warmup_rounds, self.first_pause
            return True
        self._stretch, self._pause_left = self.probe_rounds, self._next_pause
        self._next_pause = min(2 * self._next_pause, self.max_pause)
        self.pauses += 1
        return False


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


Forwards = Generator[Block, ForwardOutput, "RoundStats"]  # yields blocks to run, is sent their outputs


def run_alone(steps: Generator[Block, ForwardOutput, T], engine: TargetEngine) -> T:
    """Drive a generation that yields forward blocks on ``engine``, one block per pass (the
    batch scheduler drives many of them together instead, with ``forward_batch``)."""
    try:
        block = next(steps)
        while True:
            block = steps.send(engine.forward_batch([block])[0])
    except StopIteration as done:
        return done.value


def decode(state: DecodeState, drafter: Drafter, budget: Budget | None = None,
           fallback: Fallback | None = None) -> RoundStats:
    """Generate until the tracker finishes, alone on the engine (see ``rounds``)."""
    return run_alone(rounds(state, drafter, budget, fallback), state.engine)


@dataclass
class _Launched:
    """A round on its way: its tree (a ``DeviceTree`` until the pass brings it back), whether it
    was drafted (not a free tree), whether the fallback judges it (a drafted tree, even one the
    budget cut to nothing; None: known once a tree left on the device is back), its block's
    start, and its times so far (drafting began, the pass was launched, the launch returned)."""

    tree: Any
    drafting: bool
    proposed: bool | None
    start: int
    t0: float
    t1: float
    t2: float
    out: Any  # the pass's output, or a pending one (``Block.ahead``)


def _verification(state: DecodeState, nodes: int) -> Verification:
    """The rule a pass verifies a tree of ``nodes`` left on the device by (none: a plain step):
    random numbers drawn here, one a node and the bonus token's."""
    params = state.params
    uniforms = None if params.greedy else state.rng.random(nodes + 1)
    return Verification(params.temperature, params.top_p, params.top_k, uniforms)


def rounds(state: DecodeState, drafter: Drafter, budget: Budget | None = None,
           fallback: Fallback | None = None) -> Forwards:
    """The decode loop, as a generator that yields each round's verification block and is sent
    the target's output for it (so one loop serves a sequence alone and inside a batch).
    ``budget`` trims each proposed tree (None: verify it whole); ``fallback`` pauses drafting
    while it does not pay. While the budget or the fallback makes drafting wait, a budget still
    weighs the drafter's free tree (``Drafter.propose_free``). The drafter is told every commit,
    paused or not, so it can draft again at any round. Where the state allows it (``DecodeState.
    ahead``), a round whose tree the pass verifies on the device is launched without waiting for
    its outcome, and the next round is drafted and launched from that outcome on the device
    (``Drafter.propose_after``) before the host reads it: the host's reading of a round overlaps
    the device's next one, and the budget and fallback decide a round from what they knew a
    round earlier. Returns the rounds' statistics."""
    cache, tracker = state.cache, state.tracker
    stats = RoundStats()
    drafter.start(state.prompt_ids, state.prefill_hidden)
    passes_before = drafter.passes
    root = next_token(state.last_logits, state.params, state.rng)
    tracker.extend([root])
    context = [*state.prompt_ids, root]  # prompt + committed tokens, grown in place
    read = time.perf_counter()  # when the host last read a round's outcome
    pending: _Launched | None = None  # a round launched ahead whose outcome is still on the device

    def finish(r: _Launched, handed_over: bool) -> None:
        """Read round ``r``'s outcome: verdict, commit, what the budget and fallback learn.
        ``handed_over``: the drafter took its kept rows on the device already (``settle``)."""
        nonlocal root, read
        began = time.perf_counter()
        tree, out, synchronous = r.tree, r.out, isinstance(r.out, ForwardOutput)
        on_device = not isinstance(tree, DraftTree)
        drafted, t_pass = r.t1 - r.t0, r.t2 - r.t1  # the host's times
        if synchronous:  # the pass that read a tree left on the device also waited for the draft's device time
            waited = min(tree.device_seconds(), t_pass) if on_device else 0.0
            drafted, t_pass = drafted + waited, t_pass - waited
        else:  # launched ahead: wait for it now; the device's own times where it keeps them
            out = out.collect()
            drafted, t_pass = (on_device and tree.device_seconds()) or drafted, r.out.device_seconds() or t_pass
        if on_device:  # the tree came back with the pass
            tree = DraftTree.from_packed(out.tree)
            if len(tree) and budget is not None:
                budget.choose_after(tree, drafted)
        proposed = r.drafting and len(tree) > 0 if r.proposed is None else r.proposed
        state.target_passes += 1
        if out.kept is None:
            verdict = verify(tree, out.logits, state.params, state.rng)
        else:  # verified where it ran, the cache compacted there
            verdict = followed(tree, out.kept, out.bonus)
        taken = tracker.extend(verdict.tokens)
        context.extend(verdict.tokens[:taken])
        keep = [0] + [1 + i for i in verdict.path]
        if out.kept is None and len(tree):  # drop the rejected nodes (a lone root has none; a device tree's pass did)
            cache.compact(r.start, keep)
        t2 = time.perf_counter()
        if budget is not None:
            budget.observe(tree, len(verdict.path), t_pass)
        stats.record(tree, verdict, min(len(verdict.path), taken))
        if not tracker.finished:
            tokens = np.concatenate([[root], tree.tokens])[keep].tolist()
            if handed_over:
                drafter.settle(tokens)
            else:
                hidden = out.hidden if out.kept is not None else {k: v[keep] for k, v in out.hidden.items()}
                drafter.commit(tokens, hidden)
            root = verdict.tokens[-1]
        t3 = time.perf_counter()
        # A round launched ahead took, as far as the host can tell, the time since the last read.
        seconds = t3 - r.t0 if synchronous else t3 - read
        if proposed and fallback is not None and not fallback.keep_drafting(seconds, taken):
            if stats.fell_back_after_tokens is None:
                stats.fell_back_after_tokens = len(tracker.tokens)
            stats.fallback_pauses += 1
        stats.draft_seconds += drafted
        stats.verify_seconds += t_pass + (t2 - began)
        stats.other_seconds += t3 - t2
        read = t3

    while not tracker.finished:
        t0 = time.perf_counter()
        drafting = (fallback is None or fallback.wants_drafts()) and (budget is None or budget.wants_drafts())
        if pending is not None:  # the last round's outcome is still on the device
            room = tracker.max_new_tokens - len(tracker.tokens) - 1 - (pending.out.levels + 1)  # if it keeps every level
            depth = room if budget is None else budget.limit_depth(room)
            nodes = None if budget is None else budget.nodes_ahead()
            tree = DraftTree.empty() if drafter.plain else None  # a plain step follows as it is
            if drafting and depth >= 1 and (budget is None or nodes is not None) and not drafter.plain:
                tree = drafter.propose_after(pending.out, context, depth, nodes)
            if tree is not None:
                t1 = time.perf_counter()
                on_device = not isinstance(tree, DraftTree)
                out = yield Block((), (), cache, taps=drafter.taps, tree=tree if on_device else None,
                                  verification=_verification(state, tree.nodes if on_device else 0), ahead=True,
                                  follows=pending.out)
                launched = _Launched(tree, drafting, None if on_device else False, -1, t0, t1, time.perf_counter(), out)
                finish(pending, handed_over=True)  # while the device runs the round just launched
                pending = launched
                continue
            finish(pending, handed_over=False)  # read it first; this round starts from its outcome
            pending = None
            if tracker.finished:
                break
        depth = tracker.max_new_tokens - len(tracker.tokens) - 1  # room left after the bonus token
        if budget is not None:
            depth = budget.limit_depth(depth)
        if drafting:  # a size fixed now lets a drafter on the target's device leave its tree there (unseen)
            nodes = None if budget is None else budget.nodes_ahead()
            sized = budget is None or nodes is not None
            tree = drafter.propose_sized(context, depth, nodes) if sized else drafter.propose(context, depth)
        elif budget is not None and not budget.throughput_bound():  # drafting waits: only what costs no draft pass, if it pays
            tree = drafter.propose_free(context, depth)
        else:  # paused by the fallback with every tree verified whole, or requests wait for the batch: a plain step
            drafter.skip()
            tree = DraftTree.empty()
        on_device = not isinstance(tree, DraftTree)  # cut to size and left on the device: known after the pass
        proposed = None
        if not on_device:
            tree = tree.prune_depth(depth)
            proposed = drafting and len(tree) > 0  # judged by the fallback even when the budget keeps nothing
            if len(tree) and budget is not None:
                tree = budget.choose(tree, time.perf_counter() - t0, free=not drafting)
        t1 = time.perf_counter()
        start = cache.length
        if on_device:
            out = yield Block([root], [start], cache, taps=drafter.taps, tree=tree,
                              verification=_verification(state, tree.nodes), ahead=state.ahead)
        elif drafter.plain and state.ahead:  # a plain step the pass verifies, so that the next can follow it
            out = yield Block([root], [start], cache, taps=drafter.taps, verification=_verification(state, 0), ahead=True)
        else:
            tokens, positions, mask = _block(tree, root, start)
            out = yield Block(tokens, positions, cache, mask, taps=drafter.taps)
        launched = _Launched(tree, drafting, proposed, start, t0, t1, time.perf_counter(), out)
        if isinstance(out, ForwardOutput):
            finish(launched, handed_over=False)
        else:  # left on the device: the next round may start from it there
            pending = launched
    stats.draft_passes = drafter.passes - passes_before
    return stats
