"""What clients send and what they get back when it is refused: the request models and OpenAI's
error shape.

Parameters we cannot honour are refused with a 400 that names them, never ignored, and every
error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    field_validator,
)


class ApiError(Exception):
    """A request answered with an error: its status, OpenAI's error body and any headers."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers or {}, code

    @property
    def kind(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _not_bool(value: Any) -> Any:
    """JSON ``true`` is not a number, though pydantic's lax mode would read it as 1."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[FiniteFloat, BeforeValidator(_not_bool)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CommonParams(BaseModel):
    """The parameters both completion endpoints take. Those we cannot honour (``n`` > 1,
    penalties, logprobs) are accepted only at the value that changes nothing, and refused by name
    otherwise."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, ge=0.0, le=1.0)
    seed: Int | None = Field(None, ge=0)  # numpy seeds are non-negative; -1 ("random" in some UIs) is refused
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logprobs: bool | None = None
    user: str | None = None
    lyanna_method: str | None = Field(None, description="Lyanna extension: the decoding method for this request")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (they would change the target distribution)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if len(v or ()) > 4 or any(not s for s in v or ()):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """A list of text parts is their text, concatenated as sent; other parts (images, audio,
        files) need a model this server does not run."""
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is {kind!r}: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            texts.append(part["text"])
        return "".join(texts)

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates know it: ``developer`` is OpenAI's new name for ``system``."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(CommonParams):
    prompt: str = Field(min_length=1)


def validate(model: type[CommonParams], data: Any) -> Any:
    """``data`` as a ``model``, or a 400 naming the first field at fault."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {msg}" if param else msg, param or None) from None
