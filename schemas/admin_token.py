"""The proxy's admin token, as a deployment keeps it: who may create sessions, read or end any session,
and swap the policy's weights (``ROLLWIRE_PROXY_ADMIN_TOKEN``; see proxy/app.py).

A harness reaches the proxy (in a container, through its relay, and nothing else), so these endpoints
must not be open to it. The variable wins when it is set. Otherwise ``rollwire up`` generates a token once
into ``$ROLLWIRE_HOME/proxy-admin-token`` (mode 0600) and hands it to the proxy it starts; the operator's
tools on the same machine (``rollwire session``, ``rollwire train``) read it from there. A proxy started
any other way (``rollwire proxy`` alone, the tests) has a token only if the variable gives it one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from schemas import paths


ADMIN_TOKEN_VARIABLE = "ROLLWIRE_PROXY_ADMIN_TOKEN"
_FILE_NAME = "proxy-admin-token"


def admin_token_file() -> Path:
    return paths.home() / _FILE_NAME


def admin_token() -> str | None:
    """The token an operator's tool sends: the variable's, else the deployment's file's, else None."""
    if os.environ.get(ADMIN_TOKEN_VARIABLE):
        return os.environ[ADMIN_TOKEN_VARIABLE]
    try:
        return admin_token_file().read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def ensure_admin_token() -> str:
    """The token for a proxy this deployment starts: the variable's, else the file's, made on first use."""
    token = admin_token()
    if token is not None:
        return token
    path = admin_token_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        out.write(token + "\n")
    return token
