"""``rollwire evaluator run NAME``: run one registered evaluator as a consumer, in the foreground.

Kafka settings come from ``ROLLWIRE_*`` (schemas.transport.KafkaSettings). The evaluator's own options
are the command's: ``--all`` (score every ended session, not only those whose spec names it),
``--settings JSON`` (default settings, e.g. ``'{"command": "python -m unittest -q", "timeout_s": 60}'``),
``--concurrency`` and ``--group-id``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal

import typer

app = typer.Typer(help="Evaluators: consumers that score ended sessions.", add_completion=False,
                  no_args_is_help=True)


@app.command("run")
def run(name: str = typer.Argument(..., help="A registered evaluator: session_completed, tests, …"),
        select_all: bool = typer.Option(False, "--all", help="Score every ended session, not only those whose "
                                        "spec names this evaluator."),
        settings: str = typer.Option("{}", "--settings", help="Default settings as a JSON object; a spec that "
                                     "names this evaluator overrides them with its own."),
        concurrency: int = typer.Option(4, min=1, help="Sessions scored at once."),
        group_id: str | None = typer.Option(None, help="Consumer group (default <prefix>evaluator-NAME)."),
        log_level: str = typer.Option("info", envvar="ROLLWIRE_EVALUATOR_LOG_LEVEL")) -> None:
    """Run the evaluator NAME: session-events in, evaluations out."""
    from processors.evaluators import UnknownEvaluator, evaluator_class
    from processors.evaluators.runner import EvaluatorRunner
    from schemas.transport.admin import ensure_topics
    from schemas.transport.settings import KafkaSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cls = evaluator_class(name)
        defaults = json.loads(settings)
        if not isinstance(defaults, dict):
            raise ValueError("--settings must be a JSON object")
    except (UnknownEvaluator, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    kafka = KafkaSettings()
    runner = EvaluatorRunner(kafka, cls(defaults), select_all=select_all, concurrency=concurrency,
                             group_id=group_id)

    async def main() -> None:
        await ensure_topics(kafka)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await runner.run(stop)

    asyncio.run(main())
    typer.echo(" ".join(f"{k}={v}" for k, v in runner.counters.items()))
