"""Schemathesis hooks for test_server_schema.py, loaded through ``SCHEMATHESIS_HOOKS``.

JSON Schema cannot say that a prompt's tokens and ``max_tokens`` must fit the context window
together: the schema bounds ``max_tokens`` by the window alone, and the server refuses a request
that does not fit with a 400 (code ``context_length_exceeded``, tested in test_server.py). So
generated requests are kept to those that fit, counted with the served model's own tokenizer the
way the server counts them. ``LYANNA_SCHEMA_TEST_MODEL`` is that model's directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import schemathesis

from lyanna.engines.loading import load_tokenizer
from lyanna.serving.schema import ApiError, ChatRequest, CompletionRequest, validate

_MODEL_DIR = Path(os.environ["LYANNA_SCHEMA_TEST_MODEL"])
_TOKENIZER = load_tokenizer(_MODEL_DIR)
_CONTEXT = json.loads((_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
_REQUESTS = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}


def _prompt_tokens(request: ChatRequest | CompletionRequest) -> int:
    """As ``Decoder.encode_messages`` (chat) and ``Decoder.encode(prompt, chat=False)`` count them."""
    if isinstance(request, ChatRequest):
        text = _TOKENIZER.apply_chat_template([m.template_dict() for m in request.messages], tokenize=False,
                                              add_generation_prompt=True)
        return len(_TOKENIZER(text, add_special_tokens=False)["input_ids"])
    return len(_TOKENIZER(request.prompt)["input_ids"])


@schemathesis.hook
def filter_case(ctx: Any, case: Any) -> bool:
    """Keep every case but a valid completion request whose prompt and completion overflow the
    window (``filter_case``, not ``filter_body``: the coverage phase applies only case hooks)."""
    model = _REQUESTS.get(case.operation.path)
    if model is None:
        return True
    try:
        request = validate(model, case.body)
    except ApiError:  # an invalid body: the server must refuse it, whatever its length
        return True
    asked = request.max_completion_tokens or request.max_tokens or 1
    return _prompt_tokens(request) + asked <= _CONTEXT
