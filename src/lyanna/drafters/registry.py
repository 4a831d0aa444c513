"""Which drafter class loads which draft-head checkpoint, and the methods each provides.

The decoder asks here instead of knowing drafter names: a checkpoint's ``config.json`` names its
``arch``, and that drafter class builds every variant it defines (``VARIANTS``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..engines.base import TargetEngine
from ..engines.loading import Target
from ..errors import LyannaError
from .eagle import EagleDrafter
from .lyanna import LyannaDrafter

DRAFTER_CLASSES = {cls.ARCH: cls for cls in (EagleDrafter, LyannaDrafter)}


def checkpoint_arch(path: str | Path) -> str | None:
    """The ``arch`` a checkpoint's config.json names (None when there is no readable one)."""
    cfg_file = Path(path) / "config.json"
    try:
        arch = json.loads(cfg_file.read_text()).get("arch")
    except (OSError, ValueError, AttributeError):
        return None
    return arch if isinstance(arch, str) else None


def load_methods(path: str | Path, target: Target, engine: TargetEngine) -> dict[str, Any]:
    """The methods (name -> drafter) the checkpoint at ``path`` provides for ``target``."""
    cls = DRAFTER_CLASSES.get(checkpoint_arch(path) or "")
    if cls is None:
        known = " or ".join(repr(a) for a in DRAFTER_CLASSES)
        raise LyannaError(f"{path}: not a known draft checkpoint (need config.json with arch {known})")
    return cls.methods_from_checkpoint(path, target, engine)


def arch_providing(method: str) -> str | None:
    """The checkpoint arch whose drafter provides ``method``, if any."""
    return next((arch for arch, cls in DRAFTER_CLASSES.items() if method in cls.VARIANTS), None)
