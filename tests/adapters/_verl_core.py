"""Import verl's loss modules (``core_algos``, ``workers.utils.losses``) without ray.

``pip install --no-deps verl`` gives verl's source. Its package ``__init__`` imports ``DataProto``
(ray) and configures logging, and ``verl.workers.config`` pulls the profiler and the Ray worker
classes; the loss modules use neither at run time (``ActorConfig``/``CriticConfig`` appear in
annotations only). So the ``verl`` package is registered as a bare namespace over its real
directory (every submodule is verl's own file, unmodified) and ``verl.workers.config`` as two
placeholder classes. Nothing that the loss math reads is replaced; omegaconf and tensordict
(what the loss modules import) are installed by the ``verl`` extra.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any


def load_verl() -> tuple[Any, Any]:
    """``(core_algos, losses)`` of the installed verl, importing verl's own files."""
    if "verl.trainer.ppo.core_algos" not in sys.modules:
        spec = importlib.util.find_spec("verl")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("verl is not installed: pip install 'echoloss[verl]'")
        if "verl" not in sys.modules:
            pkg = types.ModuleType("verl")
            pkg.__path__ = list(spec.submodule_search_locations)
            pkg.__spec__ = spec
            sys.modules["verl"] = pkg
        if "verl.workers.config" not in sys.modules:
            cfg = types.ModuleType("verl.workers.config")
            cfg.ActorConfig = type("ActorConfig", (), {})  # type: ignore[attr-defined]
            cfg.CriticConfig = type("CriticConfig", (), {})  # type: ignore[attr-defined]
            sys.modules["verl.workers.config"] = cfg
    import verl.trainer.ppo.core_algos as core_algos
    import verl.workers.utils.losses as losses

    return core_algos, losses
