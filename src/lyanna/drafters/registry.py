"""Every drafter the package knows, so that nothing else needs their names.

Adding a drafter is one module and one ``@register``: its ``VARIANTS`` become methods of every
``Decoder`` (a model-free drafter) or of a ``Decoder`` that loads a checkpoint of its ``ARCH`` (a
draft head), ``lyanna bench --help`` lists them, and a head with a ``TRAINING`` recipe becomes an
``--arch`` of ``lyanna train``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..errors import LyannaError
from .base import Drafter

if TYPE_CHECKING:
    from ..engines.base import TargetEngine
    from ..engines.loading import Target

PLAIN_METHOD = "ar"  # plain autoregressive decoding: the loop with a drafter that proposes nothing

_CLASSES: list[type[Drafter]] = []  # in registration order: the order methods are listed in
D = TypeVar("D", bound=type[Drafter])


def register(cls: D) -> D:
    """Class decorator: make ``cls`` a drafter of the package (see the module's docstring)."""
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise TypeError(f"{cls!r} is not a Drafter subclass")
    if not cls.VARIANTS:
        raise TypeError(f"{cls.__name__} provides no method: give it VARIANTS")
    same = (cls.__module__, cls.__qualname__)
    others = [c for c in _CLASSES if c is not cls and (c.__module__, c.__qualname__) != same]
    taken = {PLAIN_METHOD} | {m for c in others for m in c.VARIANTS}
    clash = sorted(taken & set(cls.VARIANTS))
    if clash:
        raise TypeError(f"{cls.__name__}: method name(s) {', '.join(clash)} already taken")
    if cls.ARCH is not None and any(c.ARCH == cls.ARCH for c in _heads(others)):
        raise TypeError(f"{cls.__name__}: checkpoint arch {cls.ARCH!r} already registered")
    _CLASSES[:] = [*others, cls]  # re-registering a class (a reloaded module) replaces it
    return cls


def unregister(cls: type[Drafter]) -> None:
    """Forget ``cls`` (for tests and plugins that registered one for a while)."""
    _CLASSES[:] = [c for c in _CLASSES if c is not cls]


def drafter_classes() -> list[type[Drafter]]:
    return list(_CLASSES)


def method_names() -> list[str]:
    """``ar`` and every method a registered drafter can provide (a head's once its checkpoint is loaded)."""
    return [PLAIN_METHOD, *(m for c in _CLASSES for m in c.VARIANTS)]


def _heads(classes: list[type[Drafter]] = _CLASSES) -> list[type[Drafter]]:
    """The draft heads among ``classes`` (drafters that load a checkpoint arch)."""
    return [c for c in classes if c.ARCH is not None]


def _known_archs() -> str:
    return " or ".join(repr(c.ARCH) for c in _heads())


def trainable_archs() -> list[str]:
    """The head archs ``lyanna train`` can fit (those with a training recipe)."""
    return [c.ARCH for c in _heads() if c.TRAINING is not None]


def head_class(arch: str | None) -> type[Drafter] | None:
    """The registered head that loads checkpoints of ``arch`` (None: no such head)."""
    return next((c for c in _heads() if c.ARCH == arch), None)


def model_free_methods(target: "Target", engine: "TargetEngine") -> dict[str, Drafter]:
    """The methods of every registered model-free drafter, built for ``target``."""
    methods: dict[str, Drafter] = {}
    for c in _CLASSES:
        if c.ARCH is None:
            methods.update(c.build(target, engine))
    return methods


def checkpoint_arch(path: str | Path) -> str | None:
    """The ``arch`` a checkpoint's config.json names (None when there is no readable one)."""
    cfg_file = Path(path) / "config.json"
    try:
        arch = json.loads(cfg_file.read_text()).get("arch")
    except (OSError, ValueError, AttributeError):
        return None
    return arch if isinstance(arch, str) else None


def load_methods(path: str | Path, target: "Target", engine: "TargetEngine") -> dict[str, Drafter]:
    """The methods (name -> drafter) the checkpoint at ``path`` provides for ``target``."""
    cls = head_class(checkpoint_arch(path))
    if cls is None:
        raise LyannaError(f"{path}: not a known draft checkpoint (need config.json with arch {_known_archs()})")
    return cls.build(target, engine, Path(path))


def arch_providing(method: str) -> str | None:
    """The checkpoint arch whose drafter provides ``method``, if any."""
    return next((c.ARCH for c in _heads() if method in c.VARIANTS), None)
