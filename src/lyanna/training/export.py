"""``lyanna train export``: a fitted head as a draft checkpoint, with its model card."""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import LyannaError
from .run import TRAINING_WEIGHTS, fitted_taps, head_layers_of, iter_data, run_info


def _reply_counts(run: Path, vocab: int) -> np.ndarray:
    """How often each token is written by the assistant in the run's data (no features needed)."""
    from .corpus import reply_mask

    counts = np.zeros(vocab, np.int64)
    for row in iter_data(run):
        ids, mask = reply_mask(row)
        np.add.at(counts, ids[mask], 1)
    return counts


def _stage_costs(run: Path, fit_state: dict[str, Any]) -> str:
    """Wall time of each stage that recorded one, for the model card."""
    parts = []
    for name, f in (("data", run / "data" / "report.json"), ("features", run / "features" / "report.json")):
        if f.is_file():
            r = json.loads(f.read_text())
            if "seconds" in r:
                parts.append(f"{name} {r['seconds'] / 60:.1f} min" + (f" ({r['device']})" if r.get("device") else ""))
    where = [fit_state["device"]] if fit_state.get("device") else []
    if fit_state.get("features") == "online":
        where.append("target features computed in the fit")
    parts.append(f"fit {fit_state['seconds'] / 60:.1f} min" + (f" ({', '.join(where)})" if where else ""))
    return ", ".join(parts)


def _init_lines(init: dict[str, Any] | None, shown) -> list[str]:
    """The model card's lines on the checkpoints a continued fit descends from, newest first, each
    with its own training: a head continued in several stages shows all of them (and their cost)."""
    lines, lead = [], "- initialized from `{}` (continued training)"
    while init:
        st = init.get("settings", {})
        if st.get("train_seconds") is None:
            fit = "fit time not recorded"
        else:
            fit = f"fit {st['train_seconds'] / 60:.1f} min" + (f" ({st['device']})" if st.get("device") else "")
        lines.append(f"{lead.format(shown(init['path']))}; that head: {st.get('source', '?')} data, "
                     f"{st.get('train_reply_tokens', '?')} assistant tokens, {st.get('steps', '?')} steps, {fit}, "
                     f"held-out agreement {st.get('held_out_agreement')}")
        init, lead = st.get("init"), "  - which was initialized from `{}`"
    return lines


def _data_line(info: dict[str, Any], state: dict[str, Any]) -> str:
    """The model card's line on the training data."""
    source = info.get("source", "self-distillation")
    if source == "self-distillation":
        data = (f"prompts from `{info.get('prompts')}` answered greedily by the target, at most "
                f"{info.get('max_new_tokens')} new tokens")
    else:
        data = (f"`{source}` conversations in the target's chat template, cut to {info.get('max_tokens')} tokens, "
                "teacher-forced (the target's own next-token distribution as labels)")
    held_desc = (f"{state['held_out_examples']} held-out examples of the run `{state['eval_run']}` (the target's own replies)"
                 if state.get("eval_run") else f"{state['held_out_examples']} held out")
    return (f"- data: {state['train_examples']} training examples, {state['train_tokens']} tokens of which "
            f"{state.get('train_reply_tokens', '?')} written by the assistant ({data}); {held_desc}; "
            f"selection: {state.get('selection') or 'all'}")


def _tap_line(taps: Sequence[int]) -> str:
    """How the card names the hidden states a head reads."""
    if len(taps) == 1:
        return f"tapped hidden state: final-norm output (index {taps[0]})"
    inputs = ", ".join(str(t) for t in taps[:-1])
    return (f"tapped hidden states: the inputs of layers {inputs} and the final-norm output (indices "
            f"{list(taps)}), side by side through a learned projection")


def _card(run: Path, arch: str, model: str, taps: Sequence[int], info: dict[str, Any], state: dict[str, Any], shown,
          head_lines: list[str], decode: dict[str, Any] | None, command: str) -> str:
    """The model card (README.md) of an exported head."""
    from .fit import depth_decay_of

    st = state["settings"]
    last = state["history"][-1] if state["history"] else {}
    lines = [
        f"# {arch} draft head for {model}",
        "",
        f"Trained with Lyanna's own pipeline (`lyanna train`), {time.strftime('%Y-%m-%d')}.",
        "",
        f"- target: `{model}`, {_tap_line(taps)}",
        _data_line(info, state),
        *_init_lines(state.get("init"), shown),
        f"- steps: {state['step']} (batch {st['batch']} rows of {st.get('row_len', '-')} tokens, lr {st['lr']}, "
        f"warmup {st.get('warmup', 0)}, {st.get('labels', 'soft')} labels, unrolled depth {st['depth']}, "
        f"step k's loss weighted {depth_decay_of(st)} ** (k - 1))",
        *([f"- head: {head_layers_of(st)} decoder layers, each reading the one before's output"]
          if head_layers_of(st) > 1 else []),
        *(["- positions whose token lies outside the draft vocabulary left out of the loss (--outside-vocab mask)"]
          if st.get("outside_vocab") == "mask" else []),
        *([f"- the loss under {state['autocast']} autocast (the last sitting)"]
          if state.get("autocast", "none") != "none" else []),
        f"- cost: {_stage_costs(run, state)}",
        f"- held-out top-1 agreement with the target by depth (teacher-forced): {last.get('agreement')}",
        *head_lines,
    ]
    if decode:
        lines.append(f"- decode-time tree settings: {json.dumps(decode)}")
    lines += ["", "Reproduce:", "", "```", command or "(see run.json)", "```", ""]
    return "\n".join(lines)


def stage_export(run: Path, arch: str, out_dir: Path, name: str | None = None, hot: int = 2048, command: str = "",
                 decode: dict[str, Any] | None = None) -> Path:
    """Write the draft checkpoint (with what the head's recipe adds at export, e.g. Lyanna's
    hot-token list the table is built from) plus a model card. ``decode`` holds decode-time tree
    settings stored in the checkpoint."""
    from safetensors.numpy import load_file

    from ..drafters.checkpoint import save_head
    from ..engines.loading import load_target
    from .recipes import recipe_for

    recipe = recipe_for(arch)
    info = run_info(run)

    def shown(arg: str) -> str:  # card and config travel with the draft: no absolute machine paths in them
        p = Path(arg)
        return {Path(run): "RUN", Path(out_dir): "OUT"}.get(p, p.name) if p.is_absolute() else arg

    command, model = shlex.join(shown(a) for a in shlex.split(command)), shown(info["model"])
    fit_dir = run / "fit" / (name or arch)
    if not (fit_dir / "state.safetensors").is_file():
        raise LyannaError(f"{fit_dir} has no trained state: run `lyanna train fit --arch {arch}` first")
    state = json.loads((fit_dir / "state.json").read_text())
    if state["arch"] != arch:
        raise LyannaError(f"{fit_dir} holds a {state['arch']} head, not {arch}")
    saved = load_file(str(fit_dir / "state.safetensors"))
    weights = {k[len("head/"):]: v for k, v in saved.items() if k.startswith("head/")}
    target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
    exported = recipe.export(weights, lambda: _reply_counts(run, target.config.vocab_size), hot)
    taps = fitted_taps(state["settings"], target.config.num_layers)
    last = state["history"][-1] if state["history"] else {}
    settings = {**state["settings"], "steps": state["step"], "train_seconds": round(state["seconds"], 1),
                "train_examples": state["train_examples"], "train_tokens": state["train_tokens"],
                "train_reply_tokens": state.get("train_reply_tokens"), "source": info.get("source", "self-distillation"),
                "held_out_agreement": last.get("agreement"), "selection": state.get("selection"),
                "init": {**state["init"], "path": shown(state["init"]["path"])} if state.get("init") else None,
                "hot_tokens": exported.get("hot_tokens"), "hot_coverage": exported.get("hot_coverage"),
                "command": command, "device": state.get("device"),
                **({"decode": decode} if decode else {})}
    save_head(out_dir, arch, weights, target, taps, settings)
    head_lines = recipe.card_lines(weights, state["settings"], exported)
    (Path(out_dir) / "README.md").write_text(_card(run, arch, model, taps, info, state, shown, head_lines, decode, command))
    print(f"export: wrote {out_dir}")
    return Path(out_dir)
