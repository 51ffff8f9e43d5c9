"""``rollwire export-sft``: build (or keep building) the SFT dataset from the retained log.

Reads Kafka settings from ``ROLLWIRE_*`` (bootstrap, topic prefix). The output directory's files and what
an accepted row holds are described in sinks/sft.py. Running it twice into the same directory adds
nothing twice.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer


def export_sft(out: Path = typer.Argument(..., help="Output directory (created): sft.jsonl, sft.parquet, "
                                                    "decisions.jsonl, stats.json."),
               from_beginning: bool = typer.Option(True, "--from-beginning/--from-end", help=(
                   "Replay the retained log from its beginning (default), or read only what arrives from "
                   "now on (with --follow).")),
               min_reward: float = typer.Option(1.0, "--min-reward", help="Accept a trajectory when its "
                                                "reward is at or above this."),
               evaluator: str | None = typer.Option(None, "--evaluator", help="Only this evaluator's rewards "
                                                    "count (default: any evaluator's)."),
               follow: bool = typer.Option(False, "--follow", help="Keep running after catching up, adding "
                                           "sessions as they are evaluated (flushes every 30 s)."),
               roles: str | None = typer.Option(None, "--roles", help=(
                   "Comma-separated branch roles whose traces become rows: main, sub_agent, side (default: "
                   "ROLLWIRE_SFT_ROLES, else main,sub_agent; side calls such as title generation are left "
                   "out and counted in rows_skipped_by_role)."))) -> None:
    """Write accepted trajectories (reward >= --min-reward) as a chat-messages dataset, JSONL and Parquet,
    with acceptance statistics; prints them as name=value lines."""
    from schemas.transport.settings import KafkaSettings
    from sinks.roles import parse_roles, sft_roles_from_env
    from sinks.sft import SftCriteria, run_sft_store

    try:
        kept = parse_roles(roles) if roles is not None else sft_roles_from_env()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--roles / ROLLWIRE_SFT_ROLES") from None
    criteria = SftCriteria(min_reward=min_reward, evaluator=evaluator, roles=kept)
    stats = asyncio.run(run_sft_store(KafkaSettings(), out, criteria, from_beginning=from_beginning,
                                      follow=follow))
    for name in ("attempted", "accepted", "rows", "rows_without_messages", "evaluation_errors"):
        typer.echo(f"{name}={stats[name]}")
    typer.echo(f"by_task={json.dumps(stats['by_task'], sort_keys=True)}")
    typer.echo(f"rows_skipped_by_role={json.dumps(stats['rows_skipped_by_role'], sort_keys=True)}")
    typer.echo(f"out={out}")
    typer.echo(f"acceptance_rate={stats['acceptance_rate']}")
