"""Which engines make the pool: ``URL`` or ``NAME=URL`` entries from the settings or a pool file.

An engine's id is its name when one is given, else its URL: stable across restarts of the proxy and of the
engine, so that the engine named on a session's last completion event is the session's pin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from proxy.errors import ProxyError


class PoolConfigError(ProxyError, ValueError):
    """The pool's configuration cannot be used (empty, a malformed URL, a name given twice)."""

    kind, status_code = "engine_unavailable", 503


@dataclass(frozen=True)
class EngineEntry:
    """One engine of the pool: its id and base URL (no trailing slash)."""

    id: str
    url: str


def parse_entries(text: str, source: str) -> list[EngineEntry]:
    """The engines ``text`` names (comma- or line-separated; ``#`` starts a comment), checked."""
    entries: list[EngineEntry] = []
    for raw_line in text.replace(",", "\n").splitlines():
        item = raw_line.split("#", 1)[0].strip()
        if not item:
            continue
        name, _, url = item.rpartition("=") if "=" in item.split("://", 1)[0] else ("", "", item)
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PoolConfigError(f"{source}: {item!r} is not an engine URL (not an http(s) URL); give http(s)://host:port, "
                                  "optionally as NAME=URL")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as exc:
            raise PoolConfigError(f"{source}: {item!r} has a malformed port") from exc
        entries.append(EngineEntry(id=name.strip() or url, url=url))
    if not entries:
        raise PoolConfigError(f"{source}: the pool names no engine; give at least one URL")
    ids = [entry.id for entry in entries]
    if len(set(ids)) != len(ids):
        raise PoolConfigError(f"{source}: an engine is named twice ({', '.join(sorted(ids))})")
    return entries


def configured_entries(engine_url: str, engine_urls: str | None, pool_file: str | None) -> list[EngineEntry]:
    """The pool the settings name: the pool file, else ``ROLLWIRE_ENGINE_URLS``, else the one engine."""
    if pool_file:
        path = Path(pool_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PoolConfigError(f"ROLLWIRE_ENGINE_POOL_FILE={pool_file}: cannot be read ({exc})") from exc
        return parse_entries(text, f"ROLLWIRE_ENGINE_POOL_FILE={pool_file}")
    if engine_urls is not None:
        return parse_entries(engine_urls, "ROLLWIRE_ENGINE_URLS")
    return parse_entries(engine_url, "ROLLWIRE_ENGINE_URL")
