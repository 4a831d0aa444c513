"""Reading a request body into JSON within limits, so that no body costs more than its limit.

The server reads bodies itself instead of letting FastAPI parse them: it stops reading at
``max_bytes`` (413), and every refusal has OpenAI's error shape.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from .schema import ApiError

# A 128k-token context is about 0.5 MB of text; JSON escaping can triple that. Anything larger
# cannot be a prompt this server would accept, and reading it would only cost memory.
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON, refused with OpenAI-shaped errors: 413 past ``max_bytes`` (read
    no further), 400 when it is not UTF-8 or not JSON."""
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
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
