"""`rollwire rollout-server` (the rollout API) and `rollwire submit [--format swebench|harbor] FILE` (post a tasks
file, or a folder of Harbor tasks).

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


def submit(tasks_file: Path = typer.Argument(..., exists=True, help=(
               "JSON Lines, one TaskRequest a line; with --format swebench, SWE-bench instances (JSON array or "
               "JSON Lines); with --format harbor, a folder of Harbor task folders.")),
           server: str = typer.Option(None, help="Rollout server URL (default from ROLLWIRE_ROLLOUT_*)."),
           file_format: str = typer.Option("tasks", "--format", help=(
               "'tasks' (TaskRequest JSON Lines), 'swebench' (SWE-bench / SWE-Gym instances, each graded "
               "by the swebench evaluator in a fresh container of its image) or 'harbor' (Harbor task folders, "
               "each scored by its verifier in a fresh container of its environment image).")),
           oracle: bool = typer.Option(False, "--oracle", help="harbor: run each task's solution/solve.sh "
                                       "instead of a harness."),
           harness: str = typer.Option(None, help="Override every task's agent.harness (swebench: default "
                                       "qwen-code)."),
           samples: int = typer.Option(None, min=1, help="Override every task's num_samples (swebench: default "
                                       "1)."),
           max_tokens: int = typer.Option(None, min=1, help="swebench: engine.max_tokens of every task."),
           network: str = typer.Option(None, help="swebench: the sessions' container network (relay, host, none; "
                                       "default relay)."),
           as_json: bool = typer.Option(False, "--json", help="One JSON object a submitted task.")) -> None:
    """Submit each task of a tasks file and print its session ids; bad entries are reported by where they are."""
    from producers.rollout.taskfile import TASK_FORMATS, Overrides, TaskFormat, submit_file
    from schemas.tasks import EngineParams

    if file_format not in TASK_FORMATS:
        typer.secho(f"error: --format must be one of {', '.join(TASK_FORMATS)}, not {file_format!r}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    fmt: TaskFormat = "swebench" if file_format == "swebench" else "harbor" if file_format == "harbor" else "tasks"
    url = server or RolloutServerSettings().url
    overrides = Overrides(harness=harness, samples=samples,
                          engine=EngineParams(max_tokens=max_tokens) if max_tokens else None,
                          runtime={"network": network} if network else None, oracle=oracle)
    submitted, bad = submit_file(tasks_file, url, overrides, format=fmt)
    for line, answer in submitted:
        if as_json:
            typer.echo(json.dumps({"line": line.line_no, "where": line.label, **answer.model_dump(mode="json")}))
        else:
            typer.echo(f"{line.label}: task {answer.task_id}: {' '.join(answer.session_ids)}")
    for refused in bad:
        typer.secho(f"{refused.label}: error: {refused.error}", fg=typer.colors.RED, err=True)
    typer.echo(f"submitted={len(submitted)} refused={len(bad)}", err=True)
    if bad:
        raise typer.Exit(code=1)
