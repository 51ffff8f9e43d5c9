"""`rollwire rollout-server` (serve the rollout API) and `rollwire submit tasks.jsonl` (post a tasks file).

The main job, `rollwire rollout tasks.jsonl`, brings up a whole stack: it lives in deploy/job.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from producers.rollout.settings import RolloutServerSettings


def rollout_server(host: str = typer.Option(None, help="Listen address (ROLLWIRE_ROLLOUT_HOST)."),
                   port: int = typer.Option(None, help="Listen port (ROLLWIRE_ROLLOUT_PORT).")) -> None:
    """Serve the rollout server in the foreground."""
    import uvicorn

    from producers.rollout.server import create_app

    overrides: dict[str, Any] = {k: v for k, v in {"host": host, "port": port}.items() if v}
    settings = RolloutServerSettings(**overrides)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                access_log=False)


def submit(tasks_file: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSON Lines, one TaskRequest a line."),
           server: str = typer.Option(None, help="Rollout server URL (default from ROLLWIRE_ROLLOUT_*)."),
           harness: str = typer.Option(None, help="Override every task's agent.harness."),
           samples: int = typer.Option(None, min=1, help="Override every task's num_samples."),
           as_json: bool = typer.Option(False, "--json", help="One JSON object a submitted task.")) -> None:
    """Submit each task of a tasks file and print its session ids; bad lines are reported by number."""
    from producers.rollout.taskfile import Overrides, submit_file

    url = server or RolloutServerSettings().url
    submitted, bad = submit_file(tasks_file, url, Overrides(harness=harness, samples=samples))
    for line_no, answer in submitted:
        if as_json:
            typer.echo(json.dumps({"line": line_no, **answer.model_dump(mode="json")}))
        else:
            typer.echo(f"line {line_no}: task {answer.task_id}: {' '.join(answer.session_ids)}")
    for line in bad:
        typer.secho(f"line {line.line_no}: error: {line.error}", fg=typer.colors.RED, err=True)
    typer.echo(f"submitted={len(submitted)} refused={len(bad)}", err=True)
    if bad:
        raise typer.Exit(code=1)
