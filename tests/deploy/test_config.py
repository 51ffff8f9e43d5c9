"""``rollwire config``: every ROLLWIRE_* variable the packages mention is listed, with a meaning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from deploy.config import variables

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "proxy", "producers", "processors", "sinks", "deploy")
VARIABLE = re.compile(r"ROLLWIRE_[A-Z0-9_]+")


def _mentioned() -> set[str]:
    """What ``grep -rhoE "ROLLWIRE_[A-Z_]+"`` finds in the packages, less bare prefixes (``ROLLWIRE_GATEWAY_``)."""
    found: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".yaml", ".toml", ".j2", ".jinja"):
                found.update(VARIABLE.findall(path.read_text(errors="replace")))
    return {name for name in found if not name.endswith("_")}


def test_config_lists_every_variable_the_packages_read() -> None:
    listed = {row.name for row in variables()}
    missing = _mentioned() - listed
    assert not missing, f"read by the code but not listed by `rollwire config`: {sorted(missing)}"


def test_every_listed_variable_has_a_meaning_and_an_owner() -> None:
    rows = variables()
    assert len({row.name for row in rows}) == len(rows)
    assert [row.name for row in rows if not row.meaning.strip() or not row.owner] == []


def test_config_prints_defaults_and_current_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_PROXY_PORT", "18555")
    monkeypatch.delenv("ROLLWIRE_TOPIC_PREFIX", raising=False)
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("ROLLWIRE_PROXY_PORT="))
    assert line.startswith("ROLLWIRE_PROXY_PORT='18555'") and "default=18080" in line
    only_set = CliRunner().invoke(app, ["config", "--set"]).output
    assert "ROLLWIRE_PROXY_PORT='18555'" in only_set and "ROLLWIRE_TOPIC_PREFIX=" not in only_set


def test_docs_configuration_table_is_the_generated_one() -> None:
    table = CliRunner().invoke(app, ["config", "--markdown"]).output
    assert table in (ROOT / "docs" / "configuration.md").read_text(), (
        "docs/configuration.md is out of date: regenerate its table with `rollwire config --markdown`")
