"""The `rollwire` command: gathers the subcommands each package defines and manages the local stack.

``rollwire up`` resolves and starts the project's Apache Kafka (KRaft, one node) and creates the topics;
``rollwire down`` stops it; ``rollwire status`` reports it. Later services join the same commands.
"""

from __future__ import annotations

import asyncio
import json

import typer

from deploy.errors import DeployError
from deploy.kafka import KafkaBroker, KafkaConfig, broker_answers, ensure_topics
from proxy.cli import run as proxy_run
from proxy.cli import session_app
from schemas.cli import app as schemas_app
from schemas.transport.settings import KafkaSettings

app = typer.Typer(help="rollwire: record coding-agent harnesses token for token, as RL training data.",
                  no_args_is_help=True, add_completion=False)
app.add_typer(schemas_app, name="schemas")
app.add_typer(session_app, name="session")
app.command("proxy", help="Run the gateway proxy in the foreground.")(proxy_run)


def _local_broker_settings(config: KafkaConfig) -> KafkaSettings:
    """Settings pointing at the project's broker unless ROLLWIRE_KAFKA_BOOTSTRAP names another."""
    settings = KafkaSettings()
    if "kafka_bootstrap" not in settings.model_fields_set:
        settings = settings.model_copy(update={"kafka_bootstrap": config.bootstrap})
    return settings


def _fail(exc: DeployError) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.command()
def up(timeout_s: float = typer.Option(180.0, help="How long to wait for the broker.")) -> None:
    """Start the local stack (Apache Kafka for now) and create the topics; print its status."""
    config = KafkaConfig.from_env()
    settings = _local_broker_settings(config)
    try:
        if settings.kafka_bootstrap == config.bootstrap:
            KafkaBroker(config).start(timeout_s=timeout_s)
        elif not broker_answers(settings.kafka_bootstrap):
            raise DeployError(f"no Kafka answers at ROLLWIRE_KAFKA_BOOTSTRAP={settings.kafka_bootstrap}")
        created = asyncio.run(ensure_topics(settings.kafka_bootstrap, settings.registry(),
                                            settings.max_message_bytes))
    except DeployError as exc:
        _fail(exc)
    typer.echo(f"topics_created={len(created)}")
    status(as_json=False)


@app.command()
def down() -> None:
    """Stop the local stack."""
    try:
        KafkaBroker(KafkaConfig.from_env()).stop()
    except DeployError as exc:
        _fail(exc)
    typer.echo("kafka=stopped")


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Report the local stack: broker process, bootstrap address, whether it answers, topics."""
    config = KafkaConfig.from_env()
    settings = _local_broker_settings(config)
    managed = settings.kafka_bootstrap == config.bootstrap
    report: dict[str, object] = {"kafka_managed": managed}
    if managed:
        report.update({"kafka_" + k: v for k, v in KafkaBroker(config).status().items()})
    report["kafka_bootstrap"] = settings.kafka_bootstrap
    report["kafka_answers"] = broker_answers(settings.kafka_bootstrap)
    report["topic_prefix"] = settings.topic_prefix
    if as_json:
        typer.echo(json.dumps(report, default=str))
        return
    for name, value in report.items():
        typer.echo(f"{name}={value}")
    if not report["kafka_answers"]:
        raise typer.Exit(code=3)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
