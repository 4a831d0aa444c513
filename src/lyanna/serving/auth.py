"""API keys: who may use a server that listens beyond this machine.

A request presents its key as OpenAI's clients send it, ``Authorization: Bearer <key>``. Keys come
from ``--api-key`` (repeatable), ``LYANNA_API_KEY`` and ``--api-key-file`` (one key a line; the
file is read again whenever it changes, so keys rotate without a restart). A presented key is
compared with every key in constant time, so neither a key's contents nor its position in the list
can be read off the response time. Keys never reach a log: only how many there are, and from where.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LyannaError

ENV_KEY = "LYANNA_API_KEY"
log = logging.getLogger("uvicorn.error")


def _read_key_file(path: Path) -> tuple[bytes, ...]:
    """The keys in ``path``: one a line; blank lines and lines starting with ``#`` are skipped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return tuple(line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#"))


@dataclass
class ApiKeys:
    """The keys a server accepts. ``required`` is whether any source of keys was configured: a
    server configured with keys refuses every request when none is left (an emptied file), it never
    falls back to serving openly."""

    fixed: tuple[bytes, ...] = ()
    file: Path | None = None
    _from_file: tuple[bytes, ...] = ()
    _stamp: tuple[int, int] | None = field(default=None, repr=False)

    @classmethod
    def configure(cls, keys: list[str] | None = None, key_file: str | Path | None = None,
                  environ: dict[str, str] | None = None) -> ApiKeys:
        """Keys from the command line, the environment (``LYANNA_API_KEY``) and a file. An empty
        key or a file that cannot be read is an error here, at startup."""
        env = os.environ if environ is None else environ
        given = [*(keys or []), *([env[ENV_KEY]] if env.get(ENV_KEY) is not None else [])]
        if any(not k.strip() for k in given):
            raise LyannaError("an API key must not be empty (--api-key or LYANNA_API_KEY)")
        found = cls(fixed=tuple(k.strip().encode() for k in given), file=None if key_file is None else Path(key_file))
        if found.file is not None:
            try:
                found._reload()
            except OSError as e:
                raise LyannaError(f"cannot read the API key file {found.file}: {e.strerror or e}") from None
        return found

    @property
    def required(self) -> bool:
        return bool(self.fixed) or self.file is not None

    def describe(self) -> str:
        """How many keys and from where, for the startup log (never the keys)."""
        parts = [f"{len(self.fixed)} given"] if self.fixed else []
        if self.file is not None:
            parts.append(f"{len(self._from_file)} in {self.file} (read again when it changes)")
        return "API keys required: " + ", ".join(parts)

    def _reload(self) -> None:
        st = self.file.stat()  # type: ignore[union-attr]  # only called with a file
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._from_file, self._stamp = _read_key_file(self.file), stamp  # type: ignore[arg-type]

    def current(self) -> tuple[bytes, ...]:
        """The keys accepted now. A key file that has become unreadable keeps its last keys (a
        rotation half-written or a file briefly moved must not open the server or lock everyone
        out); a warning says so."""
        if self.file is not None:
            try:
                self._reload()
            except OSError as e:
                log.warning("cannot read the API key file %s (%s); keeping its last %d keys", self.file,
                            e.strerror or e, len(self._from_file))
        return self.fixed + self._from_file

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries an accepted key: compared with every key,
        in constant time, the loop never stopping early at a match."""
        scheme, _, presented = (authorization or "").partition(" ")
        token = presented.strip().encode()
        matched = False
        for key in self.current():
            matched |= hmac.compare_digest(token, key)
        return matched and scheme.lower() == "bearer" and bool(token)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) only ever means this machine: every address it
    resolves to is a loopback address. ``0.0.0.0`` and ``::`` listen on every interface."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # uvicorn will fail to bind it; nothing here to refuse
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_exposure(host: str, keys: ApiKeys, allow_unauthenticated: bool) -> None:
    """Refuse to serve a non-loopback address without keys unless the operator says so."""
    if keys.required or allow_unauthenticated or is_loopback(host):
        return
    raise LyannaError(
        f"refusing to serve {host} without an API key: anyone who can reach the port could use the model. "
        f"Give --api-key KEY (or set {ENV_KEY}, or --api-key-file FILE), or pass --allow-unauthenticated "
        f"if something in front of the server (a reverse proxy) already checks who may call it")
