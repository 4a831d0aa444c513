"""Reading a request body into JSON within limits, so that no body, whatever its size, encoding,
numbers or nesting, costs more than its limit or ends in anything but a 4xx.

The server reads bodies itself instead of letting FastAPI parse them: it stops reading at
``max_bytes`` (413) and refuses deep nesting before parsing (400), where a parser would otherwise
run out of stack; every refusal has OpenAI's error shape.
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from .schema import ApiError

# A 128k-token context is about 0.5 MB of text; JSON escaping can triple that. Anything larger
# cannot be a prompt this server would accept, and reading it would only cost memory.
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
# Arrays and objects nested deeper than this are refused before parsing. The deepest request the
# server accepts has 5 levels (the body, messages, a message, its content parts, a part); parsing
# and validating recurse once per level, and Python's stack allows about 1000.
MAX_JSON_DEPTH = 32

_ESCAPE = re.compile(r"\\.", re.DOTALL)  # a backslash and the character it escapes
_STRING = re.compile(r'"[^"]*"')  # a string, once its escapes are gone
_BRACKET_STEP = np.zeros(256, np.int64)  # per byte: +1 opens an array or object, -1 closes one
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON ``text``, counting brackets outside strings. For
    text that is not JSON it is at least the depth a parser reaches before it fails: up to the
    first error, strings are found as a parser finds them."""
    bare = _STRING.sub("", _ESCAPE.sub("", text))
    steps = _BRACKET_STEP[np.frombuffer(bare.encode(), np.uint8)]
    return int(np.cumsum(steps).max(initial=0))


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON, refused with OpenAI-shaped errors: 413 past ``max_bytes`` (read
    no further), 400 when it is not UTF-8, not JSON, nested deeper than ``MAX_JSON_DEPTH`` or
    holds a number Python will not read."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes (lyanna serve --max-body-bytes)")
    if declared.isdecimal() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    if (depth := nesting_depth(text)) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests arrays and objects {depth} levels deep; "
                            f"the limit is {MAX_JSON_DEPTH}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # an integer too long to convert (Python's limit on digits)
        raise ApiError(400, f"the request body cannot be read: {str(e).split(';')[0]}") from None
