"""What a successful request gets back, as models, so that ``/openapi.json`` documents it.

The handlers build their JSON answers with these models. A streamed completion is server-sent
events, each ``data:`` a chunk (OpenAI's ``chat.completion.chunk`` or ``text_completion``), an
error object when the stream fails, then ``[DONE]``; the chunk models document those events
(``reply.py`` writes them), and the schema test checks the events against them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class LyannaStats(BaseModel):
    """Lyanna extension: how the completion was decoded."""

    method: str
    tau: float | None = Field(description="Tokens committed per target forward pass")
    waste_ratio: float | None = Field(description="Share of drafted tokens that were rejected")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    finish_reason: FinishReason
    logprobs: None = None
    message: AssistantMessage


class TextChoice(BaseModel):
    index: int
    finish_reason: FinishReason
    logprobs: None = None
    text: str


class ChatCompletion(BaseModel):
    id: str
    created: int
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    lyanna: LyannaStats


class TextCompletion(BaseModel):
    id: str
    created: int
    model: str
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage
    lyanna: LyannaStats


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="Only in the first chunk")
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: None = None


class TextChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    created: int
    model: str
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="Only in the chunk after the last choice, which has no choices, "
                                                  "when stream_options.include_usage is true")


class TextCompletionChunk(BaseModel):
    id: str
    created: int
    model: str
    object: Literal["text_completion"]
    choices: list[TextChunkChoice]
    usage: Usage | None = Field(None, description="As in ChatCompletionChunk")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    lyanna_methods: list[str] = Field(description="Lyanna extension: the decoding methods a request may ask for")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    method: str = Field(description="The default decoding method")
    max_batch: int
    queue: int = Field(description="Requests queued or running")
    prefix_cache: dict[str, int] | None = Field(description="Prefix cache size and counters; null without one")
    prefill_chunk: int = Field(0, description="Prompt positions prefilled per forward pass in a batch; 0: whole prompts")
    engine: dict[str, int | float] = Field(default_factory=dict, description=(
        "The engine thread's work since start: steps (batched forward passes, each with its rounds' "
        "drafting and verification), rows (in those passes), waiting_steps (steps with requests waiting "
        "for a place in the batch, when the auto budget drafts nothing), busy_seconds (wall time in the "
        "steps) and pass_seconds (of which in the passes)"))
