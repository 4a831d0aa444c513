"""The contracts the decode loop relies on: a one-way import graph, and draft trees whose scores
are acceptance probabilities and whose merges keep sampled children lossless."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import lyanna
from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.decoding.loop import DecodeState, decode
from lyanna.decoding.sampling import SamplingParams, target_probs
from lyanna.decoding.stopping import OutputTracker
from lyanna.decoding.verify import verify
from lyanna.drafters.base import Drafter
from lyanna.drafters.checkpoint import save_head
from lyanna.drafters.eagle import DECODE_DEFAULTS as EAGLE_DEFAULTS
from lyanna.drafters.registry import arch_providing
from lyanna.drafters.suffix import SUFFIX_ACCEPTANCE, SuffixDrafter
from lyanna.drafters.tree import DraftTree
from lyanna.engines.base import ForwardOutput
from lyanna.engines.transformer import KVCache
from lyanna.errors import LyannaError
from lyanna.training.fit import init_eagle_head

PACKAGE = Path(lyanna.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """Module -> the lyanna modules it imports (function-level imports included), read with ast."""
    modules: dict[str, tuple[Path, bool]] = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (f, is_package)
    graph: dict[str, set[str]] = {}
    for name, (f, is_package) in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:  # ``from pkg import module`` imports the module
                    if f"{source}.{a.name}" in modules:
                        edges.add(f"{source}.{a.name}")
                    elif source in modules:
                        edges.add(source)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_import_graph_sees_relative_and_lazy_imports():
    graph = import_graph()
    assert "lyanna.decoding.loop" in graph["lyanna.decoding.decoder"]  # a top-level relative import
    assert "lyanna.training.fit_stage" in graph["lyanna.train"]  # an import inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_the_package():
    assert find_cycle(import_graph()) is None


# Each part may import only the parts before it (and the top-level modules errors, paths, data).
LAYERS = ["engines", "drafters", "decoding", "measure", "serving", "training"]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a part of ``LAYERS`` to a later one."""
    def part(m: str) -> int | None:
        name = m.split(".")[1] if m.count(".") else ""
        return LAYERS.index(name) if name in LAYERS else None

    return sorted(f"{m} -> {n}" for m, edges in graph.items() for n in edges
                  if part(m) is not None and part(n) is not None and part(n) > part(m))


def test_the_packages_import_one_way():
    assert upward_imports({"lyanna.engines.x": {"lyanna.decoding.y", "lyanna.errors"},
                           "lyanna.decoding.y": {"lyanna.engines.x"}}) == ["lyanna.engines.x -> lyanna.decoding.y"]
    assert upward_imports(import_graph()) == []


# ---------------------------------------------------------------- the decoder knows no drafter internals


class Counting:
    """A stand-in latency curve source that counts how often the decoder asked for it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, recalibrate: bool = False):
        self.calls += 1
        raise AssertionError("ar asked for the latency curve")


# Functions written as LLVM IR emitters (their nested codegen builds a kernel), exempt from the
# function-length rule below.
IR_EMITTERS: set[tuple[str, str]] = set()


def test_the_house_keeps_its_size_rules():
    """No module over 500 lines; no function over 60 lines in decoding/, drafters/ and engines/
    (IR emitters aside); the decode loop without nested functions or ``nonlocal``; a drafter's
    author implements at most six public methods of ``Drafter`` (the device hooks live apart, in
    ``DeviceDrafter``)."""
    long_modules = [f.name for f in PACKAGE.rglob("*.py") if len(f.read_text().splitlines()) > 500]
    assert not long_modules
    long_functions = []
    for package in ("decoding", "drafters", "engines"):
        for f in sorted((PACKAGE / package).glob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    if (f"{package}/{f.name}", node.name) not in IR_EMITTERS:
                        long_functions.append(f"{package}/{f.name}:{node.name}")
    assert not long_functions
    loop = ast.parse((PACKAGE / "decoding" / "loop.py").read_text())
    for fn in (n for n in ast.walk(loop) if isinstance(n, ast.FunctionDef)):
        assert not [m for m in ast.walk(fn) if m is not fn and isinstance(m, (ast.FunctionDef, ast.Lambda))], fn.name
    assert not [n for n in ast.walk(loop) if isinstance(n, ast.Nonlocal)]
    public = [name for name, v in vars(Drafter).items() if callable(v) and not name.startswith("_")]
    assert len(public) <= 6, public


def test_ar_goes_through_the_loop_and_never_asks_for_the_latency_curve(tiny_decoder, monkeypatch):
    d = Decoder(tiny_decoder.target, default_drafts=False)
    monkeypatch.setattr(d, "latency_curve", Counting())
    r = d.generate(d.encode("abc"), GenerationRequest(max_new_tokens=12), budget="auto", fallback=True)
    assert r.new_tokens == 12 and r.target_passes == 12  # prefill, then one pass per further token
    assert r.extra["rounds"] == 11 and r.draft_tokens == 0 and r.extra["draft_passes"] == 0


def test_a_drafter_must_subclass_drafter_and_implement_its_methods(tiny_decoder):
    class DuckTyped:  # the right methods, but not a Drafter: its optional hooks would be missing
        taps = ()
        passes = 0

        def start(self, prompt_ids, hidden): ...
        def propose(self, context, max_depth): ...
        def commit(self, tokens, hidden): ...

    class NoCommit(Drafter):
        def start(self, prompt_ids, hidden): ...
        def propose(self, context, max_depth): ...

    d = Decoder(tiny_decoder.target, default_drafts=False)
    with pytest.raises(LyannaError, match="subclass"):
        d.add_drafter("duck", DuckTyped())
    with pytest.raises(TypeError, match="commit"):
        NoCommit()
    with pytest.raises(LyannaError, match="taken"):
        d.add_drafter("ar", SuffixDrafter())


def test_decode_settings_and_variants_come_from_the_drafter_and_checkpoint(tiny_decoder, tmp_path):
    d = Decoder(tiny_decoder.target, default_drafts=False)
    with pytest.raises(LyannaError, match="needs a draft head.*'lyanna'"):
        d.generate([1, 2], method="lyanna-nofusion")
    tap = d.engine.config.num_layers
    head = init_eagle_head(d.engine, d.target.weights).numpy_weights()
    save_head(tmp_path / "default", "eagle", head, d.target, tap, settings={"depth": 9})  # a training depth
    save_head(tmp_path / "tuned", "eagle", head, d.target, tap, settings={"decode": {"depth": 2, "topk": 3}})
    assert d.load_draft(str(tmp_path / "default")) == ["eagle"]
    assert (d.drafters["eagle"].depth, d.drafters["eagle"].topk) == (EAGLE_DEFAULTS["depth"], EAGLE_DEFAULTS["topk"])
    d.load_draft(str(tmp_path / "tuned"))
    assert (d.drafters["eagle"].depth, d.drafters["eagle"].topk, d.drafters["eagle"].width) == (2, 3, EAGLE_DEFAULTS["width"])
    save_head(tmp_path / "bad", "eagle", head, d.target, tap, settings={"decode": {"dpeth": 2}})
    with pytest.raises(LyannaError, match="unknown decode settings dpeth"):
        d.load_draft(str(tmp_path / "bad"))
    assert arch_providing("lyanna-noresample") == "lyanna" and arch_providing("nope") is None


# ---------------------------------------------------------------- scores are probabilities


@pytest.mark.parametrize("bad", [[0.5, 1.5], [-0.1, 0.2], [0.5, np.nan], [3.0, 1.5]])
def test_scores_outside_the_unit_interval_are_refused(bad):
    with pytest.raises(ValueError, match=r"acceptance-probability estimates and must lie in \[0, 1\]"):
        DraftTree([4, 5], [-1, 0], bad)


def test_scores_at_the_bounds_are_accepted():
    tree = DraftTree([4, 5, 6], [-1, 0, -1], [1.0, 0.0, 0.25])
    np.testing.assert_array_equal(tree.scores, [1.0, 0.0, 0.25])
    np.testing.assert_array_equal(DraftTree.chain([1, 2]).scores, [1.0, 1.0])  # no estimate: 1


@pytest.mark.parametrize("seed", range(20))
def test_depths_and_closed_scores_follow_each_nodes_path(seed):
    """Each node's depth is its path's length and its closed score the minimum along its path
    (what ``best`` ranks by, so that any top-n is ancestor-closed), on random trees."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    parents = np.array([int(rng.integers(-1, i)) for i in range(n)], np.int64)
    tree = DraftTree(rng.permutation(n), parents, rng.random(n))  # distinct tokens name the nodes
    paths = [tree.path_to(i) for i in range(n)]
    assert tree.depths.tolist() == [len(p) for p in paths]
    assert tree.closed_scores().tolist() == [min(tree.scores[p]) for p in paths]
    node_of = {int(t): i for i, t in enumerate(tree.tokens)}
    for k in range(n + 1):  # every cut keeps each kept node's parent, still its parent
        cut = tree.best(k)
        kept = [node_of[int(t)] for t in cut.tokens]
        assert len(cut) == k
        assert [kept[p] if p >= 0 else -1 for p in cut.parents.tolist()] == [int(parents[i]) for i in kept]
        # the cut carries its nodes' depths (not computed again): they are its own paths' lengths
        assert cut.depths.tolist() == [len(cut.path_to(i)) for i in range(k)]
        assert cut.best(k // 2, cut.closed_scores()).depths.tolist() == tree.best(k // 2).depths.tolist()
        pruned = tree.prune_depth(2)
        assert pruned.depths.tolist() == [len(pruned.path_to(i)) for i in range(len(pruned))]
        assert pruned.depths.max(initial=0) <= 2


def _random_tree(rng, n: int, vocab: int, origin: int) -> DraftTree:
    parents = np.array([int(rng.integers(-1, i)) for i in range(n)], np.int64)
    return DraftTree(rng.integers(0, vocab, n), parents, rng.random(n), origin=np.full(n, origin))


@pytest.mark.parametrize("seed", range(20))
def test_merging_deterministic_trees_unites_equal_paths_and_keeps_the_best(seed):
    """The compiled merge against its definition: nodes in order (this tree's, then the other's),
    a child equal to one its merged parent already has (same token) is that node with the higher
    score and the first origin; then the best ``max_nodes`` by closed score, depth, order."""
    rng = np.random.default_rng(seed)
    a, b = (_random_tree(rng, int(rng.integers(0, 30)), 4, origin) for origin in (0, 1))  # few tokens: many equal paths
    tokens, parents, scores, origin, index = [], [], [], [], {}
    for tree in (a, b):
        remap = []
        for t, p, sc, o in zip(tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist(), tree.origin.tolist()):
            parent = remap[p] if p >= 0 else -1
            if (parent, t) in index:
                node = index[(parent, t)]
                scores[node] = max(scores[node], sc)
            else:
                node = index[(parent, t)] = len(tokens)
                tokens.append(t), parents.append(parent), scores.append(sc), origin.append(o)
            remap.append(node)
    union = DraftTree(tokens, parents, scores, origin=origin)
    for k in (0, 3, 10, len(union)):
        got = a.merged(b, k)
        order = np.lexsort((np.arange(len(union)), union.depths, -union.closed_scores()))
        want = np.sort(order[:k]) if k < len(union) else np.arange(len(union))
        assert got.tokens.tolist() == union.tokens[want].tolist()
        assert got.scores.tolist() == union.scores[want].tolist() and got.origin.tolist() == union.origin[want].tolist()
        assert [want[p] if p >= 0 else -1 for p in got.parents.tolist()] == union.parents[want].tolist()


def test_suffix_scores_are_the_measured_acceptance_rates():
    """Every node scores the measured probability that its path is accepted: the product of the
    per-token rates for the match length, falling with depth (no longer match_len/rank >= 3)."""
    d = SuffixDrafter(max_ngram=3, min_ngram=2, max_depth=3, branches=2, max_nodes=10)
    d.start([], {})
    tree = d.propose([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6], 10)  # "5 6" matched: length 2
    a = SUFFIX_ACCEPTANCE[min(SUFFIX_ACCEPTANCE)]  # length 2 is shorter than any measured: the nearest
    paths = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)): float(tree.scores[i]) for i in range(len(tree))}
    # 7 1 2 is the most recent continuation; 8 is a sibling of 1, so it gets what 1 leaves
    assert paths == pytest.approx({(7,): a, (7, 1): a * a, (7, 1, 2): a ** 3,
                                   (7, 8): a * a * (1 - a), (7, 8, 9): a ** 3 * (1 - a)})
    assert 0 < a < 1


# ---------------------------------------------------------------- merge keeps sampled children

Q = np.array([0.4, 0.3, 0.2, 0.1])
Q2 = np.array([0.1, 0.2, 0.3, 0.4])


def test_merge_keeps_sampled_children_distinct_and_their_distribution():
    a = DraftTree([1, 2, 3], [-1, -1, 0], [0.5, 0.4, 0.2], sampled_from={-1: Q, 0: Q2})
    b = DraftTree([1, 0, 2], [-1, -1, 0], [0.6, 0.3, 0.3], sampled_from={-1: Q})
    m = a.merged(b, 10)
    # the root's four samples stay four nodes (token 1 twice), a's first, all still sampled from Q
    roots = [i for i in range(len(m)) if m.parents[i] == -1]
    assert m.tokens[roots].tolist() == [1, 2, 1, 0]
    assert m.sampled_from[-1] is Q
    # a's sampled grandchild keeps Q2 under a's node; b's deterministic child sits under b's node
    assert m.sampled_from[roots[0]] is Q2 and m.tokens[m.parents == roots[0]].tolist() == [3]
    assert roots[2] not in m.sampled_from and m.tokens[m.parents == roots[2]].tolist() == [2]


def test_merge_cuts_a_tree_with_sampled_children_by_depth_not_score():
    a = DraftTree([1, 2, 3], [-1, -1, 0], [0.01, 0.01, 0.01], sampled_from={-1: Q})
    b = DraftTree([0, 3], [-1, 0], [0.9, 0.9], sampled_from={-1: Q})
    m = a.merged(b, 3)
    assert m.tokens.tolist() == [1, 2, 0] and m.depths.tolist() == [1, 1, 1]  # a prefix of the samples


def test_merge_still_dedups_deterministic_children():
    a = DraftTree([1, 2], [-1, 0], [0.5, 0.25])
    b = DraftTree([1, 2, 3], [-1, 0, -1], [0.6, 0.2, 0.1])
    m = a.merged(b, 10)
    assert m.tokens.tolist() == [1, 2, 3] and m.scores.tolist() == [0.6, 0.25, 0.1] and not m.sampled_from


@pytest.mark.parametrize("other", [
    DraftTree([0, 1], [-1, -1], [0.5, 0.5]),  # deterministic children beside sampled ones
    DraftTree([0, 1], [-1, -1], [0.5, 0.5], sampled_from={-1: Q2}),  # samples from another q
])
def test_merge_refuses_what_it_cannot_keep_lossless(other):
    sampled = DraftTree([2, 3], [-1, -1], [0.5, 0.5], sampled_from={-1: Q})
    with pytest.raises(ValueError, match="cannot merge children of node -1"):
        sampled.merged(other, 10)
    with pytest.raises(ValueError, match="cannot merge children of node -1"):
        other.merged(sampled, 10)


def test_best_refuses_to_choose_sampled_children_by_score():
    tree = DraftTree([1, 2, 3], [-1, -1, -1], [0.1, 0.9, 0.5], sampled_from={-1: Q})
    assert tree.best(3) is tree
    with pytest.raises(ValueError, match="shallowest"):
        tree.best(2)


def test_keeping_sampled_from_accepts_more_than_dropping_it():
    """Why merged keeps ``sampled_from``: the p/q rule accepts a child drawn from q with
    probability sum(min(p, q)), the rule for fixed children only with sum(p * q). (Dropping it
    loses speed, not exactness: the rule for fixed children is lossless for any candidates.)"""
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.1, 0.6, 0.2, 0.1]] * 5))
    params = SamplingParams(temperature=1.0)
    accepted = {"kept": 0, "dropped": 0}
    for _ in range(2000):
        m = DraftTree(rng.choice(4, 2, p=Q), [-1, -1], sampled_from={-1: Q}).merged(
            DraftTree(rng.choice(4, 2, p=Q), [-1, -1], sampled_from={-1: Q}), 4)
        accepted["kept"] += len(verify(m, logits, params, rng).path)
        accepted["dropped"] += len(verify(DraftTree(m.tokens, m.parents, m.scores), logits, params, rng).path)
    assert accepted["kept"] > 1.3 * accepted["dropped"]


# ---------------------------------------------------------------- end to end: a fused sampled tree

VOCAB = 4  # a small vocabulary keeps the joint outcomes few (64) and makes equal samples common
Q_ROOT = np.array([0.55, 0.25, 0.1, 0.1])  # draft distributions unlike the target's
Q_CHILD = np.array([0.1, 0.1, 0.3, 0.5])


class PathTarget:
    """A stand-in target whose logits after a token path are fixed random numbers, so the exact
    output distribution is cheap to enumerate. The decode loop, verifier, tracker and cache
    compaction run for real: the cache stores each position's token, so compaction keeps the
    committed path straight."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.table: dict[tuple[int, ...], np.ndarray] = {}

    def logits_after(self, path: tuple[int, ...]) -> np.ndarray:
        if path not in self.table:
            self.table[path] = np.random.default_rng([self.seed, *path]).normal(0.0, 1.5, VOCAB)
        return self.table[path]

    def forward(self, tokens, positions, cache, block_mask=None, logit_rows=None, taps=()):
        tokens = np.asarray(tokens, np.int64)
        n, start = len(tokens), cache.length
        mask = np.tril(np.ones((n, n), bool)) if block_mask is None else block_mask
        prefix = tuple(int(t) for t in cache.k[0, 0, :start, 0])
        cache.k[0, 0, start:start + n, 0] = tokens
        cache.length = start + n
        logits = np.stack([self.logits_after(prefix + tuple(tokens[mask[i]].tolist())) for i in range(n)])
        return ForwardOutput(logits=logits)

    def forward_batch(self, blocks):
        return [self.forward(b.tokens, b.positions, b.cache, b.block_mask, b.logit_rows, b.taps) for b in blocks]


class FusingSampler(Drafter):
    """Proposes the merge of two trees whose children were sampled i.i.d. from draft
    distributions: Lyanna's fusion of a fresh and a re-sampled tree, but with sampled children,
    which no shipped drafter has. Tree a: two root samples from Q_ROOT, one child of the first
    sampled from Q_CHILD; tree b: two root samples from Q_ROOT, each with a fixed child. The merge
    (7 nodes, cut to 6) is what gets verified."""

    taps = ()
    passes = 0

    def __init__(self, merge, seed: int):
        self.merge = merge
        self.rng = np.random.default_rng(seed)

    def start(self, prompt_ids, hidden):
        pass

    def commit(self, tokens, hidden):
        pass

    def propose(self, context, max_depth):
        a_roots, b_roots = self.rng.choice(VOCAB, 2, p=Q_ROOT), self.rng.choice(VOCAB, 2, p=Q_ROOT)
        a = DraftTree([*a_roots, self.rng.choice(VOCAB, p=Q_CHILD)], [-1, -1, 0], sampled_from={-1: Q_ROOT, 0: Q_CHILD})
        b = DraftTree([*b_roots, *((b_roots + 1) % VOCAB)], [-1, -1, 0, 1], sampled_from={-1: Q_ROOT})
        return self.merge(a, b, 6)


def folding_merge(a: DraftTree, b: DraftTree, max_nodes: int) -> DraftTree:
    """The tempting fix of a merge that dropped ``sampled_from``: equal paths still become one
    node, and the root's q is put back. Folding two equal samples into one is what biases."""
    plain = DraftTree(a.tokens, a.parents, a.scores).merged(DraftTree(b.tokens, b.parents, b.scores), max_nodes)
    return DraftTree(plain.tokens, plain.parents, plain.scores, sampled_from={-1: a.sampled_from[-1]})


class DigitTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


FUSED_PARAMS = SamplingParams(temperature=1.0)
FUSED_SAMPLES = 4000
PROMPT = [1, 2, 3]
HORIZON = 3  # the joint distribution of the first three new tokens: the root, then two drafted levels


def exact_joint(target: PathTarget) -> dict[tuple[int, ...], float]:
    probs = {(): 1.0}
    for _ in range(HORIZON):
        probs = {path + (t,): pr * pt for path, pr in probs.items()
                 for t, pt in enumerate(target_probs(target.logits_after(tuple(PROMPT) + path), FUSED_PARAMS))}
    return probs


def sampled_joint(target: PathTarget, merge) -> tuple[dict[tuple[int, ...], int], int]:
    """Outcome counts of the first HORIZON tokens over FUSED_SAMPLES generations through the decode
    loop, and the number of draft tokens committed."""
    drafter = FusingSampler(merge, seed=1)
    rng = np.random.default_rng(2)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for _ in range(FUSED_SAMPLES):
        cache = KVCache(1, 1, 1, 64)
        cache.k[0, 0, :len(PROMPT), 0] = PROMPT
        cache.length = len(PROMPT)
        tracker = OutputTracker(DigitTokenizer(), (), HORIZON + 1)
        state = DecodeState(target, cache, tracker, FUSED_PARAMS, rng, list(PROMPT), target.logits_after(tuple(PROMPT)))
        accepted += decode(state, drafter).accepted_draft_tokens
        key = tuple(tracker.tokens[:HORIZON])
        counts[key] = counts.get(key, 0) + 1
    return counts, accepted


def chi2_against(counts: dict[tuple, int], exact: dict[tuple, float]) -> tuple[float, float]:
    """Chi-square of observed outcomes against the exact distribution (outcomes expected fewer than
    5 times pooled into one cell), and its critical value at p = 1e-4 (the Wilson-Hilferty
    approximation of the chi-square quantile)."""
    assert set(counts) <= set(exact)
    n = sum(counts.values())
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, prob in exact.items():
        if prob * n >= 5:
            cells.append((counts.get(key, 0), prob * n))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + prob * n
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    z = 3.719  # the standard normal quantile at 1 - 1e-4
    return stat, dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


@pytest.fixture(scope="module")
def path_target():
    target = PathTarget()
    return target, exact_joint(target)


def test_a_fused_tree_with_sampled_children_keeps_the_target_distribution(path_target):
    target, exact = path_target
    counts, accepted = sampled_joint(target, DraftTree.merged)
    stat, limit = chi2_against(counts, exact)
    assert stat < limit
    assert accepted > FUSED_SAMPLES  # the drafts were used: more than one per generation on average


def test_folding_equal_samples_in_a_merge_fails_the_same_test(path_target):
    """The control: the same statistic rejects a merge that keeps ``sampled_from`` but folds equal
    samples into one node."""
    target, exact = path_target
    stat, limit = chi2_against(sampled_joint(target, folding_merge)[0], exact)
    assert stat > limit
