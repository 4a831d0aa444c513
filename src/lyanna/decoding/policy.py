"""Whether a round drafts and how much: one policy over the tree budget (``budget.Budget``: tree
sizes, depth, the waits after trees that did not pay, the rule for requests waiting in a batch)
and the fallback (``Fallback``: pauses of plain decoding while drafting does not pay, and probes
after them). The loop asks it once a round (``gate``, then ``plan``), has it cut the trees it sees
(``cut``, ``sized``) and tells it each round's outcome (``observe``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..drafters.tree import DraftTree
from .budget import Budget


@dataclass(frozen=True)
class Plan:
    """What the policy allows a round, decided before it drafts: ``drafting`` (False: a plain
    step, or with ``free`` only a tree that costs no draft pass), how deep (``depth``), how many
    nodes where fixed before drafting (``nodes``; None: the drafter's own cut, or, with ``seen``
    False, a size the policy must see the tree to choose)."""

    drafting: bool
    free: bool
    depth: int
    nodes: int | None
    seen: bool  # the tree must come to the host before it is cut (no size can be fixed ahead)


FALLBACK_WARMUP_ROUNDS = 8  # drafting rounds judged before the fallback may first pause drafting
# After a pause, a few drafting rounds judge whether drafting pays again: enough that one lucky or
# unlucky round does not decide, few enough that a probe of a drafter that never pays costs little.
PROBE_ROUNDS = 4
# Plain rounds of the first pause, doubled after each probe that does not pay (up to the last):
# text that turns repetitive (a summary quoting its source) is found again within a few dozen
# tokens, while a drafter that never pays probes ever more rarely.
FIRST_PAUSE_ROUNDS = 16
MAX_PAUSE_ROUNDS = 256
# The nodes an ``auto`` budget leaves on the device each drafting round where every tree size is a
# compiled, captured call (``Policy``'s ``fixed_shapes``): one size, so timed rounds meet no new
# shape; 31 with the root is a 32-row block, which on such a device costs little more than one
# row (an H200's pass time is nearly flat in its rows: docs/bench/gpu/h200-shapes-latency-*.json).
SHAPED_NODES = 31


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

    def keep_drafting(self, seconds: float, tokens: int, plain: Callable[[], float] | None = None) -> bool:
        """Account one drafting round (its seconds, the tokens it committed); False when it ends a
        stretch that did not pay, which starts a pause. ``plain``: what a plain round costs now
        (``Budget.plain_seconds``: the one-token pass as this host runs it now, with a round's host
        work), else the calibrated one-token pass: a drafting round's seconds hold its host work
        and this host's current speed, so the plain round it is weighed against must too."""
        self._rounds += 1
        self._seconds += seconds
        self._tokens += tokens
        if self._rounds < self._stretch:
            return True
        paid = self._tokens * (self._step_seconds() if plain is None else plain()) >= self._seconds
        self._rounds, self._seconds, self._tokens = 0, 0.0, 0
        if paid:
            self._stretch, self._next_pause = self.warmup_rounds, self.first_pause
            return True
        self._stretch, self._pause_left = self.probe_rounds, self._next_pause
        self._next_pause = min(2 * self._next_pause, self.max_pause)
        self.pauses += 1
        return False



class Policy:
    """The budget and the fallback as one drafting policy (either may be None: verify every tree
    whole, never pause)."""

    def __init__(self, budget: Budget | None, fallback: Fallback | None, fixed_shapes: bool = False):
        """``fixed_shapes``: on an engine where each new call shape compiles and captures
        (``engines.base.shapes_compile``), every round drafts as deep as there is room (not as
        the budget's last kept depth says, ``Budget.limit_depth``) and an ``auto`` budget leaves
        ``SHAPED_NODES`` nodes on the device (not as many as it last kept, ``nodes_ahead``): a
        depth and a tree size are each a shape, and the budget's moving round to round met new
        shapes inside timed rounds all generation long."""
        self.budget, self.fallback, self.fixed_shapes = budget, fallback, fixed_shapes
        # Whether the next drafted round catches its drafter up on many tokens: the generation's
        # first (its whole prompt) and the first after rounds that drafted nothing. Its drafting
        # time is that catch-up's, paid once (tens of ms for a head's prompt), not what a round's
        # drafting costs: such a round is timed as one that ran a shape first (``measured``
        # False), so it neither sets the drafting time, nor starts a wait, nor is judged by the
        # fallback.
        self._stale = True

    def gate(self) -> bool:
        """Whether this round may draft: the fallback's pauses and the budget's waits, asked
        once a round (each call counts one round of a pause)."""
        budget, fallback = self.budget, self.fallback
        return (fallback is None or fallback.wants_drafts()) and (budget is None or budget.wants_drafts())

    def plan(self, drafting: bool, room: int) -> Plan:
        """The round's ``Plan`` from the gate's answer, ``room`` tokens left after the bonus token."""
        budget = self.budget
        if budget is None:
            return Plan(drafting, False, room, None, False)
        free = not drafting and not budget.throughput_bound()
        fixed = self.fixed_shapes
        nodes = (SHAPED_NODES if fixed and budget.spec == "auto" else budget.nodes_ahead()) if drafting else None
        depth = room if fixed else budget.limit_depth(room)
        return Plan(drafting, free, depth, nodes, drafting and nodes is None)

    def cut(self, tree: DraftTree, seconds: float, free: bool, measured: bool = True) -> DraftTree:
        """The nodes of a tree seen on the host to verify (``seconds``: its drafting time; not
        ``measured``: a time that includes a compile, see ``Budget.choose``)."""
        if not len(tree):
            return tree
        measured = self._timed(measured, not free)
        return tree if self.budget is None else self.budget.choose(tree, seconds, free=free, measured=measured)

    def _timed(self, measured: bool, drafted: bool) -> bool:
        """Whether a round's times say what a round costs: not a compile's (``measured``), not a
        catch-up's (a ``drafted`` round while the drafter is behind)."""
        return measured and not (self._stale and drafted)

    def sized(self, tree: DraftTree, seconds: float, measured: bool = True) -> None:
        """Told a tree cut to a size fixed before drafting, once it is seen (after its pass)."""
        if len(tree) and self.budget is not None:
            self.budget.choose_after(tree, seconds, self._timed(measured, True))

    def observe(self, tree: DraftTree, accepted: int, pass_seconds: float, judged: bool, seconds: float,
                committed: int, measured: bool = True, drafted: float | None = None) -> bool:
        """A round's outcome: the budget learns how many of ``tree``'s nodes were accepted, what
        the pass cost and, given the round's ``drafted`` seconds, the host work around them (the
        round's ``seconds`` less pass and drafting); a ``judged`` round (a drafted tree) is the
        fallback's to weigh, its ``seconds`` against the ``committed`` tokens at a plain round's
        cost. True when that starts a pause. A round not ``measured`` (it ran a shape for the
        first time: ``engines.base.first_runs``) teaches acceptance only: its times are a compile's."""
        budget = self.budget
        measured = self._timed(measured, judged)
        self._stale = not judged  # a drafted round caught its drafter up; a plain one leaves it behind
        if budget is not None:
            overhead = None if drafted is None or not measured else max(0.0, seconds - pass_seconds - drafted)
            budget.observe(tree, accepted, pass_seconds if measured else None, overhead)
        judged = judged and measured
        if not judged or self.fallback is None:
            return False
        return not self.fallback.keep_drafting(seconds, committed, None if budget is None else budget.plain_seconds)
