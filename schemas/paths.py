"""Where rollwire keeps local state and downloads: the one place ``ROLLWIRE_HOME`` and ``ROLLWIRE_CACHE_DIR``
are read.

The home holds what a running stack writes (broker data, logs, pid files, worker tables, the admin token);
the cache holds what can be downloaded or built again (the Kafka jars, the vLLM CPU environment, the tiny
model, the harness CLIs, the container images' inputs). Both are read when asked for, not at import, so a
test or a command that sets the variable sees it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class PathSettings(BaseSettings):
    """The two folders every rollwire process shares."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_", extra="ignore", env_ignore_empty=True)

    home: Path = Field(default=Path("~/.rollwire"), description=(
        "Local state of the stack on this machine: broker data, engine and proxy logs, pid files, the workers' "
        "tables, the proxy's admin token."))
    cache_dir: Path = Field(default=Path("~/.cache/rollwire"), description=(
        "What can be downloaded or built again: the Kafka jars, the vLLM CPU environment, the tiny model, the "
        "pinned harness CLIs, the container images' inputs. Point it at a new folder to start from empty caches."))


def home() -> Path:
    """``$ROLLWIRE_HOME`` (default ``~/.rollwire``), expanded."""
    return PathSettings().home.expanduser()


def cache_dir() -> Path:
    """``$ROLLWIRE_CACHE_DIR`` (default ``~/.cache/rollwire``), expanded."""
    return PathSettings().cache_dir.expanduser()
