"""The deployment's proxy admin token (schemas/admin_token.py): made once, private, the variable first."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from schemas.admin_token import ADMIN_TOKEN_VARIABLE, admin_token, admin_token_file, ensure_admin_token


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.delenv(ADMIN_TOKEN_VARIABLE, raising=False)
    return tmp_path


def test_made_once_into_a_file_only_its_owner_reads(home: Path) -> None:
    assert admin_token() is None  # nothing deployed yet: the tools send none
    token = ensure_admin_token()
    assert len(token) >= 32 and admin_token_file() == home / "proxy-admin-token"
    assert stat.S_IMODE(admin_token_file().stat().st_mode) == 0o600
    assert ensure_admin_token() == token and admin_token() == token  # the same one from then on


def test_the_variable_wins_and_no_file_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_VARIABLE, "from-the-environment")
    assert ensure_admin_token() == "from-the-environment" == admin_token()
    assert not admin_token_file().exists()
