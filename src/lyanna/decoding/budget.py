"""Hardware-aware tree budget: how many draft nodes to verify each round.

On a CPU the target's forward time grows quickly with the number of tokens in a block, so the
best tree size is a property of the machine. ``calibrate`` measures the target's latency against
the block size once per model and machine (cached as JSON); ``Budget("auto")`` then keeps, each
round, the ``n`` best nodes of the drafter's candidate tree that maximize expected committed
tokens per second::

    (1 + c * sum of the n best acceptance probabilities) / (draft seconds + host work + latency(n + 1))

where the probabilities are the drafter's ``DraftTree.scores`` (each node's estimated probability
of being accepted, in [0, 1], so their sum is the expected number of accepted draft tokens) and
``c`` an online correction (accepted over predicted, recent drafted rounds weighted most; each term
``c * p`` is capped at 1), so a miscalibrated draft still gets a sensible size; ``host work`` is
what a round spends outside pass and drafting (``Budget.overhead``); the latency and the draft
seconds are priced as decoding measures them (``costs``: the curve corrected per block size, the
drafting time per depth). ``Budget(n)`` is the fixed alternative.

Under ``auto`` the budget also drafts the next tree one level deeper than the tree it kept last
round (``limit_depth``), the drafting ``choose`` prices a kept tree at: levels it would cut cost
draft passes for nothing, and a deeper window (the deepest of the last 8 kept trees) made the
bigger trees look cheaper than the rounds after them were.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ..drafters.tree import DraftTree
from ..engines.base import TargetEngine
from ..engines.loading import cache_dir
from ..engines.transformer import ENGINE_REVISION
from ..errors import LyannaError
from .costs import DraftCost, PassCost, sized_cut

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80)
# Block sizes whose latency a curve keeps in a table: a batch of 8 sequences with 128-token prefill
# chunks and their trees stays below it (larger blocks are interpolated as they come).
TABLE_ROWS = 4096


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it, with its family and model numbers: a cloud VM
    often reports only "AMD EPYC", which covers generations whose speed differs several times
    (``platform.processor()`` where there is no /proc/cpuinfo)."""
    info = _cpuinfo()
    if "model name" not in info:
        return platform.processor() or "unknown cpu"
    numbers = [f"{k} {info[k]}" for k in ("cpu family", "model") if k in info]
    return info["model name"] + (f" ({', '.join(numbers)})" if numbers else "")


def cpu_features() -> list[str]:
    """The vector instruction sets the kernels care about that this CPU reports."""
    flags = set(_cpuinfo().get("flags", "").split())
    return [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]


def machine_id() -> str:
    """A short description of what latency depends on: CPU model, core count, architecture."""
    return f"{cpu_name()} x{os.cpu_count()} {platform.machine()}"


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds of one target forward pass over a block of ``sizes[i]`` tokens."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    model: str
    machine: str
    context: int
    date: str = ""

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or len(self.sizes) != len(self.seconds) or list(self.sizes) != sorted(set(self.sizes)):
            raise LyannaError("a latency curve needs at least two distinct increasing block sizes, one time each")

    def __call__(self, n: int | np.ndarray) -> float | np.ndarray:
        """Latency of an ``n``-token block (or of each of an array of sizes): interpolated,
        extrapolated linearly past the last size (never downwards: a noisy last measurement
        must not make bigger blocks look cheaper)."""
        s, t = self.sizes, self.seconds
        slope = max(t[-1] - t[-2], 0.0) / (s[-1] - s[-2])
        if isinstance(n, (int, np.integer)):  # one size, every round: no array round trip
            if n >= s[-1]:
                return t[-1] + slope * (n - s[-1])
            if n <= s[0]:
                return t[0]
            i = bisect.bisect_right(s, n)
            return (t[i] - t[i - 1]) / (s[i] - s[i - 1]) * (n - s[i - 1]) + t[i - 1]  # np.interp's order
        n_arr = np.asarray(n, np.float64)
        out = np.where(n_arr <= s[-1], np.interp(n_arr, s, t), t[-1] + slope * (n_arr - s[-1]))
        return float(out) if out.ndim == 0 else out

    def span(self, first: int, count: int) -> np.ndarray:
        """Latencies of blocks of ``first``, ``first + 1``, ... ``first + count - 1`` tokens, read
        from a table made once (every round that sizes a tree asks, and interpolating an array
        each time cost a tenth of a round's tree sizing)."""
        if first + count <= TABLE_ROWS:
            return self._table[first:first + count]
        return self(np.arange(first, first + count))

    @cached_property
    def _table(self) -> np.ndarray:
        return self(np.arange(TABLE_ROWS))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "LatencyCurve":
        return cls(tuple(int(x) for x in data["sizes"]), tuple(float(x) for x in data["seconds"]), data["model"],
                   data["machine"], int(data["context"]), data.get("date", ""))


def model_key(name: str, engine: TargetEngine) -> str:
    c = engine.config
    shape = f"{c.hidden_size}-{c.num_layers}-{c.intermediate_size}-{c.vocab_size}"
    return f"{Path(name).name}-{shape}"


def calibration_path(name: str, engine: TargetEngine) -> Path:
    # The kernel's instruction-set path (``intdot-vnni``...) and cache (``kv_cache``) too: each has its own curve.
    kernel, kv = getattr(engine, "kernel", ""), getattr(engine, "kv_cache", "")
    digest = hashlib.sha256(f"{machine_id()} engine {engine.name} {kernel} {kv} {ENGINE_REVISION}".encode()).hexdigest()[:10]
    return cache_dir() / "calibration" / f"{model_key(name, engine)}-{digest}.json"


def calibrate(engine: TargetEngine, name: str, sizes: Sequence[int] = DEFAULT_SIZES, context: int = 256,
              repeats: int = 5) -> LatencyCurve:
    """Median latency of a causal block of each size after ``context`` cached tokens. The sizes
    are measured in turn within each of the ``repeats`` sweeps (after one warm-up sweep), so a
    machine whose speed drifts while it calibrates (a shared host) shifts every size alike
    instead of bending the curve: measured size by size, a noisy moment once made 8 tokens look
    cheaper than 6 here, and the auto budget then chose trees too big for this CPU. Each block
    follows an untimed one-token pass, as while decoding: timed after the last sweep's largest block,
    the one-token pass was dearer than a decoding step, and plain decoding priced above its cost."""
    sizes = sorted(set(int(s) for s in sizes))
    if len(sizes) < 2 or sizes[0] < 1:
        raise LyannaError(f"calibration needs at least two distinct positive block sizes, got {sizes}")
    context = max(1, min(context, engine.config.max_position_embeddings - sizes[-1]))
    rng = np.random.default_rng(0)
    cache = engine.new_cache(context + sizes[-1])
    engine.forward(rng.integers(engine.config.vocab_size, size=context), np.arange(context), cache, logit_rows=[-1])
    blocks = {n: (rng.integers(engine.config.vocab_size, size=n), np.tril(np.ones((n, n), bool))) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    step = rng.integers(engine.config.vocab_size, size=1)
    for sweep in range(repeats + 1):  # the first sweep is a warm-up
        for n, (tokens, mask) in blocks.items():
            cache.length = context
            engine.forward(step, np.arange(context, context + 1), cache)
            cache.length, t0 = context, time.perf_counter()
            engine.forward(tokens, np.arange(context, context + n), cache, block_mask=mask)
            if sweep:
                times[n].append(time.perf_counter() - t0)
    seconds = [float(np.median(times[n])) for n in sizes]
    return LatencyCurve(tuple(sizes), tuple(seconds), model_key(name, engine), machine_id(), context,
                        time.strftime("%Y-%m-%d %H:%M"))


def save_curve(curve: LatencyCurve, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(curve.to_json(), indent=1))
    tmp.replace(path)


def load_curve(path: Path) -> LatencyCurve | None:
    """The cached curve, or None when there is none or it is unreadable (then calibrate again)."""
    try:
        return LatencyCurve.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, LyannaError):
        return None


def parse_budget(text: str | int) -> int | str:
    """``auto`` or a node count >= 0."""
    if (isinstance(text, int) and not isinstance(text, bool) and text >= 0) or str(text).strip().isdecimal():
        return int(text)
    if str(text).strip() == "auto":
        return "auto"
    raise LyannaError(f"budget must be 'auto' or a number of draft nodes, got {text!r}")


# Drafting stops for a while only when the trees judged lately, on average, do not beat plain
# decoding: each judged round's margin (its best tree's rate over plain decoding's, less one; a
# tree cut to nothing loses its drafting time) is averaged with this decay, and while the average
# is not positive the rounds wait, 0, 1, 3, 7... rounds between probes (each probe judged on its
# own), up to MAX_SKIP, or further for a drafter whose probe is dear: until a probe costs at most
# PROBE_SHARE of the plain steps it waits for (a draft head's probe, ~25 ms with its catch-up and
# LM-head passes, cost 2-3% of the time at 64 rounds on a 2-core CPU where a step is ~9 ms; in a
# batch every sequence waits for it), but never more than MAX_PROBE_WAIT rounds, so that a text
# turning predictable is seen. Waiting after any one round that did not pay (the rule before) kept
# the default drafter plain in most rounds on a 2-core CPU, where a round it drafted committed
# tokens a fifth faster than one it did not.
MARGIN_DECAY = 0.7
MAX_SKIP = 64
PROBE_SHARE = 0.01
MAX_PROBE_WAIT = 16 * MAX_SKIP
# In a shared pass a tree is verified only if the pass's tokens per second beat plain decoding's
# by this fraction: its rows lengthen the pass for every sequence while its tokens go to the one
# that drafted, so a tree that only breaks even moves no throughput and spreads latency. Simulating
# the load test's 8 clients (scripts/simulate-load.py, passes priced at the latency curve), suffix
# without a margin served 1% more tokens/s than plain decoding with an 11% later median; with 5%
# its 95th percentile stayed 2% later; from 15% (30% alike) both matched, at 1.5% more tokens/s.
SHARED_MARGIN = 0.15

class Load(NamedTuple):
    """What shares a batched pass with one sequence: the ``others`` in flight beside it, the
    ``rows`` of their blocks, and the requests ``waiting`` for a place in the batch."""

    others: int
    rows: int
    waiting: int = 0


@dataclass
class Evidence:
    """What a method's drafts have been worth lately. The budgets of one method's generations in
    a batch share one, so a request that joins the batch starts from what the others learned
    (and waits with them when drafting does not pay) instead of trusting its drafter afresh."""

    predicted: float = 0.0  # decayed sums of predicted and accepted draft tokens
    accepted: float = 0.0
    draft_seconds: float | None = None  # a round's drafting time, smoothed
    drafting: DraftCost = field(default_factory=DraftCost)  # a round's drafting time by its depth
    margin: float = 0.0  # the judged trees' margins over plain decoding, averaged (see ``MARGIN_DECAY``)
    wait: int = 0  # the next wait's length (see ``Budget.wants_drafts``)

    @property
    def paid(self) -> bool:
        """Whether the trees judged lately beat plain decoding, on average (none judged: not yet)."""
        return self.margin > 0.0


def _bucket(nodes: int) -> int:
    """The most nodes whose block, with the root, fits the power-of-two row bucket that ``nodes``
    nodes and the root are padded to (the device engine runs a tree at that bucket anyway)."""
    return (1 << nodes.bit_length()) - 1


class Budget:
    """Per-generation tree-size policy: a fixed node count, or ``auto`` from a latency curve."""

    def __init__(self, spec: int | str, curve: LatencyCurve | Callable[[], LatencyCurve] | None = None,
                 decay: float = 0.8, load: Callable[[], Load | tuple[int, int]] | None = None,
                 evidence: Evidence | None = None):
        """``curve``: the latency curve, or a function giving it, called the first time a tree needs
        sizing (so a generation that never drafts never measures the machine). ``load``: inside a
        batch, what shares the pass (``Load``; see ``choose`` and ``throughput_bound``). ``evidence``:
        shared with other budgets of the same method (default: a fresh one of its own)."""
        self.spec = parse_budget(spec)
        if self.spec == "auto" and curve is None:
            raise LyannaError("budget 'auto' needs a latency curve (lyanna calibrate)")
        self._curve, self.decay, self._load = curve, decay, load
        self._curve_used = False  # whether a round needed the curve (``ar`` never does)
        self.evidence = Evidence() if evidence is None else evidence
        # Rounds still to go without drafting (see wants_drafts): a budget joining others that
        # found drafting not paying starts with their wait.
        self._skip_left = 0 if self.evidence.paid else self.evidence.wait
        self._probing = False  # whether the next judged tree ends a wait (``_judge``)
        # Measured pass seconds against the curve's prediction: a shared host that has slowed down
        # since calibration (or sped up) scales every verification cost, not the drafting time; and
        # each block size's own measures correct the curve's shape (``costs.PassCost``).
        self.cost = PassCost(decay)
        # Host seconds a round spends outside its pass and its drafting (reading the verdict,
        # committing, the loop's own work), decayed, for rounds that drafted and rounds that did
        # not: a round costs them whatever it verifies, so fewer rounds for the same tokens save
        # them. Priced only once both are measured (see ``_overheads``).
        self.overhead = {True: None, False: None}
        self._kept_depth: int | None = None  # depth of the last auto-sized tree (None: none yet)
        self._judged = False  # whether ``choose`` saw a tree since the last ``observe``
        self._ahead: int | None = None  # under ``auto``, the size of a tree fixed before drafting (None: not yet)

    @property
    def correction(self) -> float:
        """Accepted over predicted, with one pseudo-round at face value that never decays: after
        drafted rounds with nothing verified the evidence fades and drafting is tried again."""
        return (self.evidence.accepted + 1.0) / (self.evidence.predicted + 1.0)

    @property
    def slowdown(self) -> float:
        """This host's pass times over the curve's now, for every block alike (``PassCost``)."""
        return self.cost.slowdown

    @slowdown.setter
    def slowdown(self, value: float) -> None:
        self.cost.slowdown = value

    @property
    def curve(self) -> LatencyCurve:
        """The latency curve; a function giving it is asked every time (a decoder's budget lives
        across generations, and ``lyanna calibrate --force`` may replace its curve)."""
        self._curve_used = True
        return self._curve if isinstance(self._curve, LatencyCurve) else self._curve()

    def load(self) -> Load:
        """What shares the next pass (nothing outside a batch)."""
        return Load(0, 0) if self._load is None else Load(*self._load())

    def throughput_bound(self) -> bool:
        """Under ``auto``, whether requests wait for a place in this batch. Then every pass is full
        until the queue drains and throughput decides every request's latency, queue time
        included. On the 2-core CPU trees in such passes bought about what they cost: at 16
        clients on an 8-wide batch ``lyanna+suffix`` took 7% fewer steps than ``ar`` for the same
        rows, while its rounds' host work (weighing trees it mostly cut to nothing, verifying,
        bookkeeping), which ``choose``'s rate does not price, grew by 1-2 ms a step of ~25, and it
        served 0.83-0.92x ``ar`` in three load tests. So such a pass neither drafts nor weighs
        trees (AdaServe's rule: no speculation while a step is compute-bound). A fixed budget
        drafts as told."""
        return self.spec == "auto" and self._load is not None and self.load().waiting > 0

    def choose(self, tree: DraftTree, draft_seconds: float, free: bool = False, measured: bool = True) -> DraftTree:
        """The nodes to verify this round. Trees with sampled children are kept whole under
        ``auto``, and a fixed budget keeps their shallowest nodes in tree order without looking
        at scores: dropping some of their i.i.d. samples by score would bias the sampling rule.
        ``free``: a tree proposed while drafting waits (``Drafter.propose_free``): it is sized
        by its own small drafting time and says nothing about whether drafting pays. Not
        ``measured``: its drafting time includes a compile (``engines.base.first_runs``): the
        tree is sized by the drafting time known so far and says nothing either."""
        ev, depth = self.evidence, int(tree.depths.max()) if len(tree) else 1
        judged = not free and measured  # whether this tree's drafting time tells what drafting costs
        if judged:
            ev.draft_seconds = draft_seconds if ev.draft_seconds is None else 0.5 * (ev.draft_seconds + draft_seconds)
            ev.drafting.observe(depth, draft_seconds)
        elif not free:  # a catch-up's or a compile's time: more than drafting costs, so an upper bound
            ev.draft_seconds = None if ev.draft_seconds is None else min(ev.draft_seconds, draft_seconds)
            ev.drafting.at_most(depth, draft_seconds)
        seconds = draft_seconds if free or ev.draft_seconds is None else ev.draft_seconds
        self._judged = True
        if tree.sampled_from or not len(tree):
            if self.spec == "auto" or len(tree) <= self.spec:
                return tree
            return tree.shallowest(int(self.spec))
        if self.spec != "auto":
            return tree.best(int(self.spec))
        # Alone, tokens per second of this sequence. In a batch, of the whole pass: the others
        # commit at least one token each and already put their rows in the block, so a node
        # costs what it adds to the total block; where the pass is compute-bound (many rows)
        # that exceeds what it is worth and the tree shrinks towards plain decoding by itself.
        others, other_rows, _ = self.load()
        drafting_round, plain_round = self._overheads()
        by_depth = None if free else ev.drafting.by_depth()  # a free tree's own time prices it whatever its depth
        keep, rate, one_row, kept = sized_cut(tree.tokens, tree.parents, tree.scores, tree.origin, tree.depths,
                                              self.correction, others + 1.0,
                                              np.array([seconds]) if by_depth is None else by_depth, drafting_round,
                                              self.slowdown, self.curve.span(other_rows + 1, len(tree) + 1),
                                              self.cost.factors, other_rows + 1)  # passes of 0, 1, ... nodes
        seconds += drafting_round
        plain_pass = self.slowdown * one_row + plain_round
        if others and rate < (1.0 + SHARED_MARGIN) * (others + 1.0) / (seconds + plain_pass):
            keep = 0
        if judged:
            self._judge(rate * plain_pass / (others + 1.0) - 1.0 if keep else -seconds / (seconds + plain_pass),
                        int(seconds * (others + 1) / (PROBE_SHARE * plain_pass)))
        if keep >= len(tree):
            chosen = tree
        else:  # the size ``sized_cut`` kept, or none in a shared pass it does not pay
            chosen = DraftTree.valid(*kept) if keep == len(kept[0]) else tree.best(keep)
        self._kept_depth = int(chosen.depths.max()) if len(chosen) else (self._kept_depth or 0)  # ``limit_depth``
        if keep and not free:
            self._ahead = _bucket(keep)
        return chosen

    def _judge(self, margin: float, dear: int) -> None:
        """Average a judged round's ``margin`` into the evidence and, while the average is not
        positive, start the next wait (``MARGIN_DECAY``). A probe, the round after a wait, is
        judged on its own: averaged with the rounds before its wait, a probe that paid left the
        average negative, and the waits doubled while drafting paid. A wait lasts at most MAX_SKIP
        rounds, or ``dear`` where more (the plain steps of which a probe costs PROBE_SHARE; in a
        batch a probe's drafting stalls every sequence of the pass, so it counts once for each),
        never more than MAX_PROBE_WAIT."""
        ev = self.evidence
        ev.margin = margin if self._probing else MARGIN_DECAY * ev.margin + (1 - MARGIN_DECAY) * margin
        self._probing = False
        if ev.paid:
            ev.wait = 0
            return
        longest = min(MAX_PROBE_WAIT, max(MAX_SKIP, dear))
        self._skip_left, ev.wait = ev.wait, min(2 * ev.wait + 1, longest)

    def _overheads(self) -> tuple[float, float]:
        """The host seconds outside pass and drafting of a drafting round and of a plain one. Both
        0 until both were measured: ``choose`` then weighs pass and drafting alone, as it did
        before it knew them (a drafting round's alone against nothing for plain rounds would
        price drafting above its cost; the plain rounds of a pause or a wait measure theirs)."""
        drafting, plain = self.overhead[True], self.overhead[False]
        return (0.0, 0.0) if drafting is None or plain is None else (drafting, plain)

    def plain_seconds(self) -> float:
        """What a plain round (one token) costs now: the one-token pass of the curve, scaled by
        this host's measured ``slowdown``, plus a plain round's host work once measured."""
        return self.slowdown * float(self.curve(1)) + self._overheads()[1]

    def nodes_ahead(self) -> int | None:
        """The size of a tree fixed before drafting (``Drafter.propose_sized``: a drafter on the
        target's device leaves its tree there, unseen until the pass): a fixed budget's; under
        ``auto``, as many nodes as it last kept, filled up to the row bucket they take anyway
        (a power of two with the root), one bucket more after a tree it would have kept whole
        (``choose_after``); None before ``auto`` has kept any: the tree must be seen first."""
        return self._ahead if self.spec == "auto" else int(self.spec)

    def choose_after(self, tree: DraftTree, draft_seconds: float, measured: bool = True) -> None:
        """``choose``'s bookkeeping for a tree verified at the size fixed before drafting (and,
        under ``auto``, the next such size)."""
        chosen = self.choose(tree, draft_seconds, measured=measured)
        if self.spec == "auto" and len(chosen) == len(tree) > 0:  # kept whole: the next may be larger
            self._ahead = _bucket(len(tree) + 1)

    def limit_depth(self, room: int) -> int:
        """How deep to draft this round, at most ``room``: under ``auto``, one level deeper than
        the last tree kept (so a tree that fills its depth lets the next one grow a level: what
        ``choose`` priced it at), on the first round to ``room``; a fixed budget of ``n`` nodes no
        deeper than ``n`` (a chain step drafted below that could never be verified). A tree cut
        to nothing leaves that depth: one level deep, the next draft shows nothing deeper."""
        if self.spec != "auto":
            return min(room, int(self.spec))
        return room if self._kept_depth is None else min(room, self._kept_depth + 1)

    def wants_drafts(self) -> bool:
        """Whether to propose a tree this round: not while requests wait for the batch
        (``throughput_bound``), nor while a wait set by ``choose`` lasts (the last tree did not
        beat plain decoding, drafting time included)."""
        if self.throughput_bound():
            return False
        if self._skip_left:
            self._skip_left -= 1
            self._probing = not self._skip_left
            return False
        return True

    def observe(self, tree: DraftTree, accepted: int, seconds: float | None = None,
                overhead: float | None = None) -> None:
        """Learn how the drafter's estimates compare with what verification accepted, and, given
        the pass's measured ``seconds`` alone, how this host's speed compares with the latency
        curve's, and, given the round's ``overhead`` (host seconds outside pass and drafting),
        what a drafting or a plain round adds to them. Evidence decays with every drafted round,
        those whose trees were cut to nothing included (so drafting is tried again after a
        while), but not over rounds that drafted nothing: a pause in drafting must not make its
        probe trust estimates that did not pay."""
        alone = not self.load().others
        if seconds is not None and self._curve_used and alone:
            self.cost.observe(len(tree) + 1, seconds, self.curve(len(tree) + 1))
        judged, self._judged = self._judged, False
        if overhead is not None and alone:
            kept = self.overhead[judged]
            self.overhead[judged] = overhead if kept is None else self.decay * kept + (1 - self.decay) * overhead
        if not (len(tree) or judged):
            return
        predicted = float(np.minimum(tree.closed_scores(), 1.0).sum()) if len(tree) else 0.0
        ev = self.evidence
        ev.predicted = self.decay * ev.predicted + predicted
        ev.accepted = self.decay * ev.accepted + accepted
