"""Every ``ROLLWIRE_*`` variable the code reads, in one list: what ``rollwire config`` prints.

Each service's settings class is the source of its variables (name from the class's prefix and the field,
default and meaning from the field); the few variables that are not a service's setting (the installer's
virtual environment, what the gateway node hands a harness) are listed here with their meaning. Only
``deploy/`` knows every service, so the list lives here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import typer
from pydantic_settings import BaseSettings

from deploy.settings import EngineServerSettings, KafkaLauncherSettings, ProxyTierSettings
from processors.evaluators.judge_settings import JudgeSettings
from processors.groups.settings import GroupSettings
from processors.trajectories.settings import ProcessorSettings
from producers.gateway.settings import GatewaySettings
from producers.rollout.settings import RolloutServerSettings
from proxy.settings import ProxySettings
from schemas.paths import PathSettings
from schemas.transport.settings import KafkaSettings
from schemas.ui_links import UiLinkSettings
from sinks.roles import SinkRoleSettings
from sinks.ui.settings import UiSettings


@dataclass(frozen=True)
class Variable:
    """One environment variable: who reads it, its default, and what it sets."""

    name: str
    owner: str
    default: str
    meaning: str

    @property
    def current(self) -> str | None:
        """Its value in this process's environment, or None when unset."""
        return os.environ.get(self.name)


SERVICES: tuple[tuple[str, type[BaseSettings]], ...] = (
    ("paths", PathSettings),
    ("kafka clients", KafkaSettings),
    ("kafka launcher", KafkaLauncherSettings),
    ("embedded engine", EngineServerSettings),
    ("proxy", ProxySettings),
    ("proxy tier", ProxyTierSettings),
    ("gateway node", GatewaySettings),
    ("rollout server", RolloutServerSettings),
    ("trajectory worker", ProcessorSettings),
    ("groups worker", GroupSettings),
    ("judge evaluator", JudgeSettings),
    ("sinks", SinkRoleSettings),
    ("web page", UiSettings),
    ("web page links", UiLinkSettings),
)

# Read by something other than a service's settings class.
OTHER: tuple[Variable, ...] = (
    Variable("ROLLWIRE_VENV", "deploy/rollwire.sh", ".venv",
             "The virtual environment the launcher script installs rollwire into and runs it from."),
    Variable("ROLLWIRE_EVALUATOR_LOG_LEVEL", "rollwire evaluator run", "info", "Log level of an evaluator process."),
    Variable("ROLLWIRE_RUNTIME_ROOT", "local and docker runtimes", "<tmp>/rollwire-sessions",
             "Where session workspaces (and a container's relay socket) are made."),
)

# Set by the gateway node for a harness it runs (the `command` adapter's placeholders, Codex's key); read by
# the harness, never by rollwire.
HARNESS: tuple[Variable, ...] = tuple(
    Variable(name, "given to the harness", "(per session)", meaning) for name, meaning in (
        ("ROLLWIRE_BASE_URL", "The session's OpenAI-compatible base URL."),
        ("ROLLWIRE_ANTHROPIC_BASE_URL", "The session's Anthropic Messages base URL."),
        ("ROLLWIRE_GEMINI_BASE_URL", "The session's Gemini base URL."),
        ("ROLLWIRE_API_KEY", "The session's API key."),
        ("ROLLWIRE_CODEX_KEY", "The session's API key, where Codex's provider config reads it."),
        ("ROLLWIRE_MODEL", "The model name the harness is pinned to."),
        ("ROLLWIRE_SESSION_ID", "The session's id."),
        ("ROLLWIRE_INSTRUCTION", "The task's instruction."),
        ("ROLLWIRE_WORKSPACE", "The session's workspace folder."),
    ))


def _field_variables(owner: str, settings: type[BaseSettings]) -> list[Variable]:
    prefix = str(settings.model_config.get("env_prefix", ""))
    found = []
    for name, field in settings.model_fields.items():
        alias = field.validation_alias
        variable = alias if isinstance(alias, str) else f"{prefix}{name}".upper()
        # A default made when the settings are read (a path under the home, this host's name) is described in
        # the meaning rather than shown as this machine's value.
        default = "(derived)" if field.default_factory is not None else field.get_default()
        found.append(Variable(variable, owner, "" if default is None else _show(default),
                              " ".join((field.description or "").split())))
    return found


def _show(value: object) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(str(item) for item in value)
    return str(value)


def variables() -> list[Variable]:
    """Every variable, each once (the first owner that reads it names it), in the order above."""
    seen: dict[str, Variable] = {}
    for owner, settings in SERVICES:
        for variable in _field_variables(owner, settings):
            seen.setdefault(variable.name, variable)
    for variable in (*OTHER, *HARNESS):
        seen.setdefault(variable.name, variable)
    return list(seen.values())


def markdown(rows: list[Variable]) -> str:
    """The variables as the Markdown table ``docs/configuration.md`` holds."""
    lines = ["| variable | read by | default | what |", "|---|---|---|---|"]
    for row in rows:
        default = f"`{row.default}`" if row.default else "(unset)"
        lines.append(f"| `{row.name}` | {row.owner} | {default} | {row.meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def show_config(markdown_table: bool = typer.Option(False, "--markdown", help=(
                    "Print the Markdown table docs/configuration.md holds instead.")),
                only_set: bool = typer.Option(False, "--set", help="Only the variables set in this environment.")) -> None:
    """Print every ROLLWIRE_* variable the code reads: its default, its value here, and what it sets."""
    rows = [row for row in variables() if not only_set or row.current is not None]
    if markdown_table:
        typer.echo(markdown(rows), nl=False)
        return
    for row in rows:
        current = "(unset)" if row.current is None else repr(row.current)
        typer.echo(f"{row.name}={current}  default={row.default or '(unset)'}  [{row.owner}]")
        typer.echo(f"    {row.meaning}")
