"""Links into the web page (``rollwire ui``, sinks/ui): its URL for a run, a session or a trace, for
whatever prints them (the main job's summary, ``rollwire session new``). The page's routes are an HTTP
API like any other, so their shape lives here, where every layer can read it.

The UI's address is ``ROLLWIRE_UI_URL`` (default ``http://127.0.0.1:8790``, where ``rollwire ui``
listens by default). A run id is the main job's (its task ids end in ``-r<run id>``).
"""

from __future__ import annotations

from urllib.parse import quote

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_UI_PORT = 8790
DEFAULT_UI_URL = f"http://127.0.0.1:{DEFAULT_UI_PORT}"


class UiLinkSettings(BaseSettings):
    """Where the web page is reached from, for whatever prints links to it."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_UI_", extra="ignore", env_ignore_empty=True)

    url: str = Field(default=DEFAULT_UI_URL, description=(
        "The web page's address as printed links use it (the summary's, `rollwire session new`'s)."))


def ui_base_url() -> str:
    """The UI's base URL (``ROLLWIRE_UI_URL``, no trailing slash)."""
    return UiLinkSettings().url.rstrip("/")


def _join(path: str, base: str | None) -> str:
    return (base.rstrip("/") if base is not None else ui_base_url()) + path


def home_url(base: str | None = None) -> str:
    return _join("/", base)


def run_url(run_id: str, base: str | None = None) -> str:
    """The run page: its tasks, groups and sessions with their timelines."""
    return _join(f"/runs/{quote(run_id, safe='')}", base)


def session_url(session_id: str, base: str | None = None) -> str:
    """The session page: its calls, their messages and the branch tree."""
    return _join(f"/sessions/{quote(session_id, safe='')}", base)


def trace_url(session_id: str, trace_index: int = 0, base: str | None = None) -> str:
    """The token page of the session's ``trace_index``-th trace (in its trajectory's order)."""
    return _join(f"/sessions/{quote(session_id, safe='')}/traces/{trace_index}", base)
