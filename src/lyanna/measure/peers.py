"""Peer methods in child processes, so that a peer that dies cannot take the bench down with it.

llama-cpp-python built with native flags on a host that advertises AMX dies with SIGILL on a batch
of a few hundred tokens; in the bench's own process that lost every method's results. Each peer
kind (``hf`` for both Hugging Face methods, each ``llamacpp*`` method) runs in one long-lived
child started with the "spawn" context (no fork of a process holding threads and compiled
kernels), so its model loads once. The child times each generation itself and sends back the
``GenerationResult``: the pipe's cost is never in a peer's seconds. A child that dies, by a
signal or any exit, raises :class:`PeerFailed` here; the bench reports that method failed and
keeps every other.

The child builds its peer from a named factory (``"module:function"``, called with keyword
arguments), which is how a test injects a stand-in peer without patching the bench.
"""
from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import signal
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import LyannaError

# What a llama.cpp peer that died says beside its signal: the one crash seen so far was a native
# build on an Intel host with AMX, which its kernels then use on batches of ~300 tokens.
LLAMACPP_HINT = ('on hosts with AMX build llama-cpp-python with CMAKE_ARGS="-DGGML_NATIVE=OFF" '
                 "(see docs/engine.md)")
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class Peer:
    """How to build a peer in its child. ``factory`` ("module:function", a class or a function)
    is called there with ``kwargs`` and returns an object whose ``generate(ids, n, **call)``
    returns a ``GenerationResult``. Methods with the same ``kind`` share one child (built from
    the first one's factory), so a model serving two methods loads once. ``hint`` follows the
    failure message when the child dies."""

    kind: str
    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)
    hint: str = ""


class PeerFailed(LyannaError):
    """A peer's child died (``signal``: the name of the signal that killed it, else None) or its
    generate raised: the method has no more results to give in this run."""

    def __init__(self, message: str, signal_name: str | None = None):
        super().__init__(message)
        self.signal = signal_name


def _resolve(name: str) -> Callable[..., Any]:
    module, _, attr = name.partition(":")
    if not attr:
        raise LyannaError(f"peer factory {name!r} is not 'module:function'")
    return getattr(importlib.import_module(module), attr)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, LyannaError) else f"{type(e).__name__}: {e}"


def _child(conn: Any, factory: str, kwargs: dict[str, Any]) -> None:
    """The child's loop: build the peer, then answer each (method name, args, kwargs) with
    ("ok", value) or ("error", message) until told to stop (None) or the parent goes away.
    Ctrl-C is left to the parent, which then closes the child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        peer = _resolve(factory)(**kwargs)
    except Exception as e:  # a configuration error (no such package, not a GGUF model): the parent raises it
        conn.send(("error", _describe(e)))
        return
    conn.send(("ok", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        name, args, kw = request
        try:
            reply = ("ok", getattr(peer, name)(*args, **kw))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            reply = ("error", _describe(e))
        try:
            conn.send(reply)
        except OSError:  # the parent is gone
            return


class PeerProcess:
    """One spawned child serving one peer. Making one starts the child and returns at once (so
    several children load their models side by side); ``wait_ready`` waits for the peer."""

    def __init__(self, peer: Peer):
        self.peer = peer
        self.failure: PeerFailed | None = None
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(child_conn, peer.factory, peer.kwargs),
                                   name=f"lyanna-peer-{peer.kind}", daemon=True)
        self.process.start()
        child_conn.close()  # only the child holds its end: its death is an EOF here

    def wait_ready(self) -> None:
        """Block until the peer is built. A Python error building it is the caller's mistake and
        raises ``LyannaError``; a child that died building it is recorded, to fail its first call."""
        try:
            status, message = self.conn.recv()
        except (EOFError, OSError):
            self._died()
            return
        if status == "error":
            self.close()
            raise LyannaError(message)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``peer.name(*args, **kwargs)`` in the child; ``PeerFailed`` once the child is dead,
        or when the call raised there (the child is then closed: its state is unknown)."""
        if self.failure is not None:
            raise self.failure
        try:
            self.conn.send((name, args, kwargs))
            status, value = self.conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if status == "error":
            self.failure = PeerFailed(f"{self.peer.kind}: {name} raised {value}")  # no crash: no build hint
            self.close()
            raise self.failure
        return value

    def _died(self) -> PeerFailed:
        self.process.join(CLOSE_WAIT_S)
        code = self.process.exitcode
        name = None
        if code is None:
            what = "child process stopped answering"
            self.process.kill()
        elif code < 0:
            name = _signal_name(-code)
            what = f"child process killed by {name} ({signal.strsignal(-code)})"
        else:
            what = f"child process exited with status {code}"
        self.failure = PeerFailed(f"{self.peer.kind}: {what}" + (f"; {self.peer.hint}" if self.peer.hint else ""), name)
        return self.failure

    def close(self) -> None:
        """Ask the child to stop, then end it if it does not within ``CLOSE_WAIT_S``."""
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(CLOSE_WAIT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.conn.close()


class PeerRunner:
    """A bench runner, ``(ids, n) -> GenerationResult``, for one method of a peer child. The text
    is decoded here (``decode``), after the child's clock stopped, so the child needs no tokenizer."""

    def __init__(self, process: PeerProcess, call: Mapping[str, Any], decode: Callable[[list[int]], str] | None):
        self.process, self.call, self.decode = process, dict(call), decode

    def __call__(self, ids: Sequence[int], max_new_tokens: int) -> Any:
        result = self.process.call("generate", [int(t) for t in ids], max_new_tokens, **self.call)
        if self.decode is not None and not result.text:
            result = dataclasses.replace(result, text=self.decode(result.tokens))
        return result

    def close(self) -> None:
        self.process.close()


def start_peers(peers: Mapping[str, Peer], decode: Callable[[list[int]], str] | None = None) -> dict[str, PeerRunner]:
    """A runner per method spec; one child per peer kind, all started before any is waited for."""
    processes: dict[str, PeerProcess] = {}
    try:
        for peer in peers.values():
            if peer.kind not in processes:
                processes[peer.kind] = PeerProcess(peer)
        for process in processes.values():
            process.wait_ready()
    except BaseException:
        for process in processes.values():
            process.close()
        raise
    return {spec: PeerRunner(processes[p.kind], p.call, decode) for spec, p in peers.items()}


class _Call:
    """The peer behind :func:`call_in_child`: a plain function."""

    def __init__(self, func: Callable[..., Any]):
        self.func = func

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


def call_in_child(func: Callable[..., Any], *args: Any, kind: str = "child", hint: str = "", **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` in a spawned child (``func`` must be importable there, or
    defined in the main script); ``PeerFailed`` names the signal if the child dies."""
    process = PeerProcess(Peer(kind=kind, factory=f"{__name__}:_Call", kwargs={"func": func}, hint=hint))
    try:
        process.wait_ready()
        return process.call("run", *args, **kwargs)
    finally:
        process.close()
