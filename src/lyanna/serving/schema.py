"""What clients send and what they get back when it is refused: the request models and OpenAI's
error shape.

The models are the server's contract: they validate every request and, through their JSON
schemas, document it in ``/openapi.json``. Where a validator accepts more than its type says (a
lone ``stop`` string, a list of text parts as ``content``) or refuses part of it (``n`` other than
1), the field's JSON schema says so too, so the documented contract is the enforced one.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FiniteFloat,
    Strict,
    ValidationError,
    WithJsonSchema,
    field_validator,
)

# At most this many stop strings, as OpenAI's API allows.
MAX_STOPS = 4


class ErrorDetail(BaseModel):
    message: str
    type: Literal["invalid_request_error", "rate_limit_error", "server_error"]
    param: str | None = Field(description="The request field at fault, when one is")
    code: str | None = Field(description="A machine-readable reason, such as context_length_exceeded or timeout")


class ErrorResponse(BaseModel):
    """Every error response, in OpenAI's shape."""

    error: ErrorDetail


class ApiError(Exception):
    """A request answered with an error: its status, OpenAI's error body and any headers."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers or {}, code

    @property
    def kind(self) -> Literal["invalid_request_error", "rate_limit_error", "server_error"]:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


def _json_number(value: Any) -> Any:
    """JSON ``true`` and ``"5"`` are not numbers, though pydantic's lax mode would read them as 1 and 5."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected a number, got a {'boolean' if isinstance(value, bool) else 'string'}")
    return value


Int = Annotated[int, BeforeValidator(_json_number)]
# Bounds go before the validator so that the JSON schema shows them (as minimum) in a nullable field.
TokenCount = Annotated[int, Field(ge=1), BeforeValidator(_json_number)]
Seed = Annotated[int, Field(ge=0), BeforeValidator(_json_number)]  # numpy seeds; -1 ("random" in some UIs) is refused
Float = Annotated[FiniteFloat, BeforeValidator(_json_number)]
Bool = Annotated[bool, Strict()]  # lax mode would read 1, "yes" and "on" as true


def _one_stop_is_a_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
                          {"type": "null"}]}
Stops = Annotated[list[str] | None, BeforeValidator(_one_stop_is_a_list), WithJsonSchema(_STOP_SCHEMA)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False


class CommonParams(BaseModel):
    """The parameters both completion endpoints take. Those we cannot honour (``n`` > 1,
    penalties, logprobs) are accepted only at the value that changes nothing, and refused by name
    otherwise."""

    model_config = ConfigDict(
        extra="forbid",
        # stream_options needs stream true: the server refuses it otherwise.
        json_schema_extra={"anyOf": [{"properties": {"stream_options": {"type": "null"}}},
                                     {"properties": {"stream": {"const": True}}, "required": ["stream"]}]})

    model: str | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: Stops = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(1, json_schema_extra={"const": 1})
    presence_penalty: Float = Field(0.0, json_schema_extra={"const": 0})
    frequency_penalty: Float = Field(0.0, json_schema_extra={"const": 0})
    logprobs: Annotated[Bool | None, WithJsonSchema({"enum": [False, None]})] = None
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

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if len(v or ()) > MAX_STOPS or any(not s for s in v or ()):
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


def _text_parts(value: Any) -> Any:
    """A list of text parts is their text, concatenated as sent; other parts (images, audio,
    files) need a model this server does not run."""
    if not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"part {i} is {kind!r}: only text parts ({{'type': 'text', 'text': ...}}) are supported")
        texts.append(part["text"])
    return "".join(texts)


_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
Content = Annotated[str, BeforeValidator(_text_parts),
                    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]})]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    name: str | None = None

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
