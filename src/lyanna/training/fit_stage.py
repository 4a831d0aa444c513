"""``lyanna train fit``: a draft head fitted on a run's features, resumable, data-parallel under torchrun."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import LyannaError
from .run import (OUTSIDE_VOCAB, TRAINING_WEIGHTS, coverage, draft_vocabulary, feature_taps, fitted_taps, head_layers_of,
                  load_data_examples, load_examples, run_info, split_held_out, token_frequencies, training_engine)


def _distributed() -> tuple[int, int]:
    """(rank, world) under torchrun, initializing the process group once; (0, 1) otherwise."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        import torch

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to a tenth of ``lr`` at ``steps``
    (a function of the step alone, so a resumed run continues the same schedule)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _batches(train: list, row_len: int, rows_per_batch: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """One epoch of packed batches: a seeded shuffle, first-fit packing, rows grouped into batches."""
    from .fit import pack

    order = np.random.default_rng([seed, epoch]).permutation(len(train))
    rows = [[int(order[i]) for i in row] for row in pack([train[i] for i in order], row_len)]
    rows = [rows[i] for i in np.random.default_rng([seed, epoch, 1]).permutation(len(rows))]
    return [rows[i:i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]


def _tap_columns(examples: list, stored: Sequence[int], taps: Sequence[int], hidden: int) -> list:
    """(id, Example) pairs whose features hold ``taps`` only, in that order, from features of ``stored``."""
    if tuple(taps) == tuple(stored):
        return examples
    cols = np.concatenate([np.arange(hidden) + stored.index(t) * hidden for t in taps])
    return [(eid, dataclasses.replace(ex, features=ex.features[:, cols])) for eid, ex in examples]


def _fit_examples(run: Path, selection: str | None, eval_run: Path | None, max_train_tokens: int | None,
                  eval_examples: int, online: bool = False) -> tuple[list, list]:
    """(train, held-out) examples as (id, Example) pairs: the run's split, a selection's training
    part judged on the whole run's held-out split, ``eval_run`` wholly held out, and a prefix of
    the seeded order holding ``max_train_tokens`` assistant tokens (the data-scaling points).
    ``online``: the examples come without features, from the runs' data."""
    load = load_data_examples if online else load_examples
    ids = set(json.loads((run / "select" / selection).read_text())["ids"]) if selection else None
    # a scaling run loads a little more than it needs: the held-out split takes one example in 20
    train, held = split_held_out(load(run, ids, int(max_train_tokens * 1.2) if max_train_tokens else None))
    if eval_run is not None:  # a run nothing is trained on: all of it is held out
        held = load(Path(eval_run))
    elif ids is not None:  # every arm of a selection is judged on the same held-out split: the whole run's
        held = split_held_out(load(run))[1]
    if ids is not None:
        held_ids = {e[0] for e in held}
        train = [e for e in train if e[0] in ids and e[0] not in held_ids]
        if not train:
            raise LyannaError(f"selection {selection} keeps no training examples")
    if max_train_tokens:
        kept, total = [], 0
        for e in train:
            if total >= max_train_tokens:
                break
            kept.append(e)
            total += int(e[1].scored().sum())
        train = kept
    return train, held[:eval_examples]


def _featured(examples: list, rows: Sequence[Sequence[int]], featurize, row_len: int) -> list:
    """``examples`` with the features of those in ``rows`` computed by ``featurize`` (a
    ``TargetFeatures``), each over the tokens a batch row can hold (causal: the same rows as over
    the whole example); the others left as they are."""
    need = sorted({i for row in rows for i in row})
    out = list(examples)
    for i, f in zip(need, featurize.of([examples[i].tokens[:row_len] for i in need])):
        out[i] = dataclasses.replace(examples[i], features=f)
    return out


def _new_state(arch: str, selection: str | None, settings: dict[str, Any], train: list, held: list,
               eval_run: Path | None) -> dict[str, Any]:
    """A fit's state.json before its first step."""
    return {
        "arch": arch, "step": 0, "history": [], "seconds": 0.0, "selection": selection, "settings": settings,
        "train_examples": len(train), "held_out_examples": len(held),
        "train_tokens": int(sum(len(ex.tokens) for _, ex in train)),
        "train_reply_tokens": int(sum(ex.scored().sum() for _, ex in train)),
        "eval_run": Path(eval_run).name if eval_run else None,
    }


class _Fit:
    """One fit's head, optimizer and files: resumes from ``out`` and saves there."""

    def __init__(self, out: Path, head, state: dict[str, Any], lr: float, device: str):
        import torch

        self.out, self.head, self.state = out, head.to(device), state
        if str(device).startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = True  # the head's matmuls; labels come from fp32-exact features
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr)
        if (out / "state.safetensors").is_file():
            self._restore(device)

    def _restore(self, device: str) -> None:
        import torch
        from safetensors.torch import load_file

        saved = load_file(str(self.out / "state.safetensors"), device=str(device))
        self.head.load_state_dict({k[len("head/"):]: v for k, v in saved.items() if k.startswith("head/")}, strict=False)
        names = [n for n, p in self.head.named_parameters() if p.requires_grad]
        for n, p in zip(names, self.params):
            if f"opt/{n}/exp_avg" in saved:
                self.opt.state[p] = {"step": torch.tensor(float(self.state["step"])), "exp_avg": saved[f"opt/{n}/exp_avg"],
                                     "exp_avg_sq": saved[f"opt/{n}/exp_avg_sq"]}

    def save(self) -> None:
        """Head, optimizer moments and state.json; the tensors appear whole or not at all."""
        from safetensors.torch import save_file

        tensors = {f"head/{k}": v.detach().clone().contiguous() for k, v in self.head.state_dict().items()}
        for n, p in self.head.named_parameters():
            st = self.opt.state.get(p)
            if st:
                tensors[f"opt/{n}/exp_avg"] = st["exp_avg"].contiguous()
                tensors[f"opt/{n}/exp_avg_sq"] = st["exp_avg_sq"].contiguous()
        save_file(tensors, str(self.out / ".state.tmp"))
        os.replace(self.out / ".state.tmp", self.out / "state.safetensors")
        (self.out / "state.json").write_text(json.dumps(self.state, indent=2))

    def evaluate(self, held: list, row_len: int, batch: int, depth: int, device: str) -> list[float]:
        """Teacher-forced top-1 agreement with the target by depth on the held-out examples."""
        from .fit import batch_agreement, make_batch, pack

        hits, counts = np.zeros(depth), np.zeros(depth)
        rows = pack(held, row_len)
        for i in range(0, len(rows), batch):
            h, c = batch_agreement(self.head, make_batch(held, rows[i:i + batch], row_len, device), depth)
            hits += h
            counts += c
        return [round(float(x), 4) for x in hits / np.maximum(counts, 1)]


def _loss_module(fit: _Fit, depth: int, labels: str, world: int, drafted, autocast: str | None):
    """The head's unrolled loss as a module (wrapped for data parallelism when ``world`` > 1),
    scoring the tokens of ``drafted`` (``fit.drafted_tokens``; None: all), under bfloat16
    autocast when ``autocast`` says so (the labels' softmax and the losses stay fp32)."""
    import torch

    from .fit import batch_loss, depth_decay_of

    decay = depth_decay_of(fit.state["settings"])
    kind = torch.device(fit.state["device"]).type

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = fit.head

        def forward(self, b, counts: list[float] | None) -> torch.Tensor:
            if b is None:  # more ranks than rows: take part in the gradient average with zero
                return sum(p.sum() * 0 for p in fit.params)
            with torch.autocast(kind, dtype=torch.bfloat16, enabled=autocast == "bfloat16"):
                return batch_loss(self.head, b, depth, decay=decay, labels=labels, counts=counts, drafted=drafted)

    if world == 1:
        return Loss()
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(Loss())


def stage_fit(run: Path, arch: str, steps: int, batch: int = 8, lr: float = 3e-4, depth: int = 4, rank: int = 32,
              draft_vocab: int | float = 8192, selection: str | None = None, seed: int = 0, eval_every: int = 50,
              save_every: int = 50, name: str | None = None, row_len: int = 2048, warmup: int = 0,
              labels: str = "soft", device: str = "cpu", eval_run: Path | None = None, max_train_tokens: int | None = None,
              eval_examples: int = 64, init: Path | None = None, until: int | None = None,
              taps: Sequence[int] | None = None, depth_decay: float | None = None,
              head_layers: int | None = None, features: str = "stored",
              time_limit: float | None = None, outside_vocab: str | None = None,
              autocast: str | None = None) -> dict[str, Any]:
    """Train a draft head on packed batches of ``batch`` rows of ``row_len`` tokens;
    data-parallel under torchrun (every rank takes a slice of each batch's rows). Held-out
    agreement is measured on this run's held-out split, or on all of ``eval_run`` (for example
    the target's own replies, when training on a corpus). ``init``, a draft checkpoint of the
    same arch, is the starting point instead of the target's last layer (continued training on
    new data, e.g. the target's own replies after a corpus); a Lyanna head keeps its draft
    vocabulary and rank. ``until`` stops after that step while the learning-rate schedule still
    spans ``steps`` (a long fit over several sittings: rerun with a later ``until``, or none, to go on).
    ``taps``: the hidden states the head reads, some of those the run's features hold (default:
    all of them), so that one features stage serves fits on several choices of taps. ``depth_decay``:
    the loss of unrolled step k weighs ``depth_decay ** (k - 1)`` (None: ``fit.DEPTH_DECAY``).
    ``head_layers``: the head's decoder layers (None: one, or what the fit being resumed has); a
    deeper head continued from a shallower ``init`` starts as it (its further layers pass their
    input through). ``features``: ``stored`` (the features stage's shards) or ``online`` (each
    batch's target features computed in the fit through the Hugging Face model on ``device``,
    as the features stage computes them: a run needs only its data, never the features' disk).
    ``time_limit``: stop after the step that reaches this many seconds of fitting, judged and saved
    there (a lent machine's time; rerun to go on). ``outside_vocab``: ``fit.OUTSIDE_VOCAB`` (None:
    ``score``, or what the fit being resumed has). ``autocast``: ``bfloat16`` runs the loss under
    bfloat16 autocast (a GPU's tensor cores), None or ``none`` in fp32; chosen per sitting."""
    import torch

    from ..drafters.checkpoint import check_taps, head_layer_count, head_taps, load_head
    from ..drafters.registry import head_class
    from ..engines.loading import load_target
    from .fit import DEPTH_DECAY, depth_decay_of, drafted_tokens
    from .recipes import recipe_for

    recipe = recipe_for(arch)
    if steps < 1 or batch < 1 or depth < 1 or row_len < 2:
        raise LyannaError("steps, batch and depth must be >= 1 and --row-len >= 2")
    if labels not in ("soft", "hard"):
        raise LyannaError(f"--labels must be soft or hard, got {labels!r}")
    if depth_decay is not None and not depth_decay > 0.0:
        raise LyannaError(f"--depth-decay must be > 0, got {depth_decay}")
    if head_layers is not None and head_layers < 1:
        raise LyannaError(f"--head-layers must be >= 1, got {head_layers}")
    if outside_vocab is not None and outside_vocab not in OUTSIDE_VOCAB:
        raise LyannaError(f"--outside-vocab must be one of {', '.join(OUTSIDE_VOCAB)}, got {outside_vocab!r}")
    if autocast not in (None, "none", "bfloat16"):
        raise LyannaError(f"--autocast must be none or bfloat16, got {autocast!r}")
    if features not in ("stored", "online"):
        raise LyannaError(f"--features must be stored or online, got {features!r}")
    online = features == "online"
    if time_limit is not None and not time_limit > 0:
        raise LyannaError(f"--time-limit must be > 0 seconds, got {time_limit}")
    rank_id, world = _distributed()
    if time_limit is not None and world > 1:  # the ranks would stop at different steps
        raise LyannaError("--time-limit runs in one process, not under torchrun")
    if batch % world:
        raise LyannaError(f"--batch {batch} must be a multiple of the {world} processes")
    info = run_info(run)
    target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
    if online:  # the features are made with exactly the head's taps
        taps = check_taps(taps, target.config.num_layers)
    else:
        stored = feature_taps(run)
        taps = stored if taps is None else check_taps(taps, target.config.num_layers)
        held_taps = feature_taps(Path(eval_run)) if eval_run is not None else stored
        for where, have in (("the run's features", stored), (f"--eval-run {eval_run}'s features", held_taps)):
            if not set(taps) <= set(have):
                raise LyannaError(f"the head reads taps {list(taps)}; {where} hold {list(have)}: "
                                  "make features with those taps (`lyanna train features --taps`)")
    train, held = _fit_examples(run, selection, eval_run, max_train_tokens, eval_examples, online)
    if not online:
        h = target.config.hidden_size
        train, held = _tap_columns(train, stored, taps, h), _tap_columns(held, held_taps, taps, h)
    engine = training_engine(target)
    out = run / "fit" / (name or arch)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"batch": batch, "row_len": row_len, "lr": lr, "warmup": warmup, "labels": labels, "depth": depth,
                "rank": rank, "draft_vocab": draft_vocab, "seed": seed, "taps": list(taps),
                "depth_decay": DEPTH_DECAY if depth_decay is None else depth_decay, "head_layers": head_layers or 1,
                "outside_vocab": outside_vocab or "score"}
    state_json = out / "state.json"
    state = (json.loads(state_json.read_text()) if state_json.is_file()
             else _new_state(arch, selection, settings, train, held, eval_run))
    if state["arch"] != arch:
        raise LyannaError(f"{out} holds a {state['arch']} run; pass another --name")
    fitted = fitted_taps(state["settings"], target.config.num_layers)
    if fitted != taps:
        raise LyannaError(f"{out} fits a head on taps {list(fitted)}, not {list(taps)}; pass another --name")
    fitted_decay = depth_decay_of(state["settings"])
    if depth_decay is not None and depth_decay != fitted_decay:
        raise LyannaError(f"{out} fits with --depth-decay {fitted_decay}, not {depth_decay}; pass another --name")
    layers = head_layers_of(state["settings"])
    if head_layers is not None and head_layers != layers:
        raise LyannaError(f"{out} fits a head of {layers} layer(s), not {head_layers}; pass another --name")
    fitted_outside = state["settings"].get("outside_vocab", "score")  # fits from before the setting scored them
    if outside_vocab is not None and outside_vocab != fitted_outside:
        raise LyannaError(f"{out} fits with --outside-vocab {fitted_outside}, not {outside_vocab}; pass another --name")
    state["device"] = str(device)
    state["features"] = features
    state["autocast"] = autocast or "none"
    start = None
    if init is not None:
        init_config, start = load_head(init, target, head_class(arch))
        start_taps = head_taps(init_config, target.config.num_layers, init)
        if len(start_taps) > 1 and start_taps != taps:
            raise LyannaError(f"--init {init} reads taps {list(start_taps)}, this run's features hold {list(taps)}")
        if head_layer_count(start) > layers:
            raise LyannaError(f"--init {init} has {head_layer_count(start)} layers, more than this head's {layers}: "
                              "pass --head-layers")
        state.setdefault("init", {"path": str(init), "settings": init_config.get("settings", {})})
    counts = token_frequencies(train, target.config.vocab_size)
    d2t = draft_vocabulary(counts, state["settings"]["draft_vocab"])
    head = recipe.init_head(engine, target.weights, d2t, state["settings"], start, seed)
    _report_coverage(state, counts, getattr(head, "d2t", None), start is not None and rank_id == 0)
    if start is not None:  # a one-tap head continued on several taps keeps the projection's start (the final tap)
        head.load_state_dict({**head.state_dict(),
                              **{k: torch.from_numpy(np.asarray(v)) for k, v in start.items() if k not in recipe.EXPORT_ONLY}})
    featurize = None
    if online:  # after every check of the flags: the target's model loads now
        from ..engines.loading import resolve_model
        from .features import TargetFeatures

        featurize = TargetFeatures(resolve_model(info["model"]), device, taps)
        held_rows = [[i] for i in range(len(held))]
        held = list(zip([eid for eid, _ in held], _featured([ex for _, ex in held], held_rows, featurize, row_len)))
    fit = _Fit(out, head, state, lr, device)
    _train(fit, [ex for _, ex in train], [ex for _, ex in held], steps, until, lr, warmup, depth, labels, batch,
           row_len, seed, eval_every, save_every, device, (rank_id, world), f"from {init}" if start is not None else None,
           featurize, time_limit, drafted_tokens(fit.head, fitted_outside == "mask"))
    if world > 1:  # every rank waits for rank 0's last save, then leaves the group before exiting (no abort in teardown)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return state


def _report_coverage(state: dict[str, Any], counts: np.ndarray, d2t: Any, inherited: bool) -> None:
    """Record (and say) how much of this run's target tokens the head's draft vocabulary holds:
    a token outside it is never drafted. An ``--init`` head keeps its own vocabulary, chosen on
    its first data, which may cover less of this run's."""
    if d2t is None:  # a head without a draft vocabulary (eagle's full one)
        return
    vocabulary = np.asarray(d2t.cpu() if hasattr(d2t, "cpu") else d2t)
    state["draft_vocab_coverage"] = round(coverage(counts, vocabulary), 4)
    if inherited:
        print(f"draft vocabulary: {vocabulary.size} tokens (the --init head's), covering "
              f"{state['draft_vocab_coverage']:.1%} of this run's target tokens; this run's most frequent "
              f"{vocabulary.size} would cover {coverage(counts, draft_vocabulary(counts, vocabulary.size)):.1%}")


def _train(fit: _Fit, train: list, held: list, steps: int, until: int | None, lr: float, warmup: int, depth: int,
           labels: str, batch: int, row_len: int, seed: int, eval_every: int, save_every: int, device: str,
           ranks: tuple[int, int], continued: str | None, featurize=None, time_limit: float | None = None,
           drafted=None) -> None:
    """The steps from ``fit.state["step"]`` to ``until`` (or ``steps``), with held-out agreement
    every ``eval_every`` steps and a save every ``save_every``, both on rank 0; ``featurize``
    computes each batch's features (``held`` has its own already); past ``time_limit`` seconds
    the step that ends is the last; ``drafted``: the tokens the loss scores (None: all)."""
    import torch
    from tqdm import tqdm

    from .fit import make_batch, scored_counts

    rank_id, world = ranks
    state = fit.state
    model = _loss_module(fit, depth, labels, world, drafted, state["autocast"])
    bar = tqdm(total=steps, initial=state["step"], desc=f"fit {state['arch']}", unit="step", dynamic_ncols=True,
               disable=rank_id != 0 or os.environ.get("LYANNA_NO_PROGRESS") == "1")
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + time_limit
    # epochs pack differently, so their lengths differ: walk them up to the current step
    epoch, epoch_start = 0, 0
    epoch_batches = _batches(train, row_len, batch, seed, 0)
    positions = 0
    drafted_host = None if drafted is None else drafted.cpu()  # for the whole batch's counts (data-parallel)
    if continued and state["step"] == 0 and rank_id == 0:  # where the continued head starts
        state["history"].append({"step": 0, "epoch": 0.0, "loss": None,
                                 "agreement": fit.evaluate(held, row_len, batch, depth, device), "seconds": 0.0})
        bar.write(f"step 0 ({continued}): held-out agreement by depth {state['history'][-1]['agreement']}")
    last = steps if until is None else min(until, steps)
    while state["step"] < last:
        step = state["step"]
        while step - epoch_start >= len(epoch_batches):
            epoch_start += len(epoch_batches)
            epoch += 1
            epoch_batches = _batches(train, row_len, batch, seed, epoch)
        rows = epoch_batches[step - epoch_start]
        # every rank divides by the whole batch's scored rows, times the ranks DDP averages over
        # (one process: its own rows are the whole batch, batch_loss counts them itself)
        counts = ([c / world for c in scored_counts(make_batch(train, rows, row_len, features=False), depth, drafted_host)]
                  if world > 1 else None)
        mine = rows[rank_id::world]
        b = None
        if mine:
            b = make_batch(_featured(train, mine, featurize, row_len) if featurize else train, mine, row_len, device)
        for g in fit.opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(b, counts)
        fit.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(fit.params, 1.0)
        fit.opt.step()
        positions += b.positions * world if b is not None else 0
        state["step"] = step + 1
        bar.update(1)
        elapsed = state["seconds"] + time.perf_counter() - t0
        rate = positions / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", pos_s=f"{rate:.0f}")
        done = state["step"] == last or (deadline is not None and time.perf_counter() >= deadline)
        if rank_id == 0 and (state["step"] % eval_every == 0 or done):
            acc = fit.evaluate(held, row_len, batch, depth, device)
            at = epoch + (step - epoch_start) / len(epoch_batches)
            state["history"].append({"step": state["step"], "epoch": round(at, 3), "loss": round(float(loss.detach()), 4),
                                     "agreement": acc, "seconds": round(elapsed, 1)})
            bar.write(f"step {state['step']} (epoch {at:.2f}): loss {float(loss.detach()):.4f}, "
                      f"held-out agreement by depth {acc}, {rate:.0f} positions/s")
        if rank_id == 0 and (state["step"] % save_every == 0 or done):
            state["seconds"] += time.perf_counter() - t0
            state["positions_per_s"] = round(positions / max(time.perf_counter() - t0, 1e-9), 1)
            t0 = time.perf_counter()
            positions = 0
            fit.save()
        if done:
            break
    bar.close()
