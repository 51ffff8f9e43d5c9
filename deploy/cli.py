"""The `rollwire` command: gathers the subcommands each package defines and manages the local stack.

``rollwire up`` brings up, in order: the project's Apache Kafka (KRaft, one node) and its topics, the
embedded engine (the real vLLM CPU build over the tiny local model) unless ``ROLLWIRE_ENGINE_URL`` names
another engine, the gateway proxy, and a trajectory worker (processors). ``rollwire down`` stops them;
``rollwire status`` reports them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import typer

from deploy.errors import DeployError
from deploy.kafka import KafkaBroker, KafkaConfig, broker_answers, ensure_topics
from deploy.services import ServiceProcess
from processors.cli import rebuild as processors_rebuild
from processors.cli import run as processors_run
from processors.settings import ProcessorSettings
from producers.gateway.cli import gateway_node
from proxy.cli import run as proxy_run
from proxy.cli import session_app
from proxy.settings import ProxySettings
from schemas.cli import app as schemas_app
from schemas.transport.settings import KafkaSettings
from sinks.export import export_sft

app = typer.Typer(help="rollwire: record coding-agent harnesses token for token, as RL training data.",
                  no_args_is_help=True, add_completion=False)
app.add_typer(schemas_app, name="schemas")
app.add_typer(session_app, name="session")
app.command("proxy", help="Run the gateway proxy in the foreground.")(proxy_run)
app.command("processors", help="Run a trajectory worker (Faust) in the foreground.")(processors_run)
app.command("rebuild", help="Re-derive trajectories from the log with a builder, to a topic.")(processors_rebuild)
app.command("export-sft", help="Build the SFT dataset (JSONL, Parquet, acceptance stats) from the log.")(export_sft)
app.command("gateway-node", help="Run a gateway node (sessions → harness runs) in the foreground.")(gateway_node)
# Rollouts (issue 6): the rollout server, submitting a tasks file, and the main job.
from producers.rollout import cli as rollout_cli  # noqa: E402

app.command("rollout-server", help="Run the rollout server in the foreground.")(rollout_cli.rollout_server)
app.command("submit", help="Submit a tasks file (JSON Lines) to the rollout server.")(rollout_cli.submit)
app.command("rollout", help="Run a tasks file end to end: bring up the stack, run, summarize.")(rollout_cli.rollout)
# Issue 7: evaluators and the groups worker (processors/evaluators, processors/groups).
from processors.evaluators.cli import app as evaluator_app  # noqa: E402
from processors.groups.cli import run as groups_run  # noqa: E402

app.add_typer(evaluator_app, name="evaluator")
app.command("groups", help="Run a groups worker (Faust): trajectories + evaluations -> GRPO groups.")(groups_run)

# Harness prompts run to ~16k tokens; the tiny model's KV cache holds 64k at 64 MiB.
DEFAULT_ENGINE_MAX_MODEL_LEN = 32768


def _local_broker_settings(config: KafkaConfig) -> KafkaSettings:
    """Settings pointing at the project's broker unless ROLLWIRE_KAFKA_BOOTSTRAP names another."""
    settings = KafkaSettings()
    if "kafka_bootstrap" not in settings.model_fields_set:
        settings = settings.model_copy(update={"kafka_bootstrap": config.bootstrap})
    return settings


def _engine_config():  # -> deploy.engine.server.EngineConfig (imported lazily: it is only for the embedded engine)
    from deploy.engine.server import EngineConfig

    config = EngineConfig.from_env()
    if "ROLLWIRE_ENGINE_MAX_MODEL_LEN" not in os.environ:
        config = dataclasses.replace(config, max_model_len=DEFAULT_ENGINE_MAX_MODEL_LEN)
    return config


def _engine_url() -> str | None:
    """The external engine the user named, or None for the embedded one."""
    return os.environ.get("ROLLWIRE_ENGINE_URL") or None


def _proxy_service(kafka: KafkaSettings, engine_url: str) -> ServiceProcess:
    proxy = ProxySettings()
    return ServiceProcess(name="proxy", args=("proxy", "--host", proxy.proxy_host, "--port", str(proxy.proxy_port),
                                              "--engine-url", engine_url),
                          health_url=f"http://{proxy.proxy_host}:{proxy.proxy_port}/health",
                          env={"ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap})


def _processors_service(kafka: KafkaSettings) -> ServiceProcess:
    conf = ProcessorSettings()
    return ServiceProcess(name="processors", args=("processors",),
                          health_url=f"http://{conf.host}:{conf.port}/health",
                          env={"ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap})


def _fail(exc: DeployError) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.command()
def up(timeout_s: float = typer.Option(1800.0, help="How long to wait for each part (the first engine "
                                                    "start installs vLLM)."),
       engine: bool = typer.Option(True, help="Start the embedded engine (ignored with ROLLWIRE_ENGINE_URL)."),
       proxy: bool = typer.Option(True, help="Start the gateway proxy."),
       processors: bool = typer.Option(True, help="Start a trajectory worker.")) -> None:
    """Start the local stack (Kafka and topics, engine, proxy, processors) and print its status."""
    config = KafkaConfig.from_env()
    settings = _local_broker_settings(config)
    try:
        if settings.kafka_bootstrap == config.bootstrap:
            KafkaBroker(config).start(timeout_s=min(timeout_s, 300))
        elif not broker_answers(settings.kafka_bootstrap):
            raise DeployError(f"no Kafka answers at ROLLWIRE_KAFKA_BOOTSTRAP={settings.kafka_bootstrap}")
        created = asyncio.run(ensure_topics(settings.kafka_bootstrap, settings.registry(),
                                            settings.max_message_bytes))
        typer.echo(f"topics_created={len(created)}")
        if processors:
            _processors_service(settings).start(timeout_s=min(timeout_s, 120))
        engine_url = _engine_url()
        if engine_url is None and engine:
            from deploy.engine.server import VllmServer

            server = VllmServer(_engine_config())
            server.start(timeout_s=timeout_s)
            engine_url = server.url
        if proxy and engine_url is not None:
            _proxy_service(settings, engine_url).start()
    except DeployError as exc:
        _fail(exc)
    status(as_json=False)


@app.command()
def down() -> None:
    """Stop the local stack (proxy, processors, embedded engine, Kafka)."""
    config = KafkaConfig.from_env()
    try:
        _proxy_service(_local_broker_settings(config), "").stop()
        typer.echo("proxy=stopped")
        _processors_service(_local_broker_settings(config)).stop()
        typer.echo("processors=stopped")
        if _engine_url() is None:
            from deploy.engine.server import VllmServer

            VllmServer(_engine_config()).stop()
            typer.echo("engine=stopped")
        KafkaBroker(config).stop()
    except DeployError as exc:
        _fail(exc)
    typer.echo("kafka=stopped")


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Report the local stack: broker, engine, proxy and processors, and whether each answers."""
    config = KafkaConfig.from_env()
    settings = _local_broker_settings(config)
    managed = settings.kafka_bootstrap == config.bootstrap
    report: dict[str, object] = {"kafka_managed": managed}
    if managed:
        report.update({"kafka_" + k: v for k, v in KafkaBroker(config).status().items()})
    report["kafka_bootstrap"] = settings.kafka_bootstrap
    report["kafka_answers"] = broker_answers(settings.kafka_bootstrap)
    report["topic_prefix"] = settings.topic_prefix
    engine_url = _engine_url()
    if engine_url is None:
        from deploy.engine.server import VllmServer

        server = VllmServer(_engine_config())
        report.update({"engine_" + k: v for k, v in server.status().items() if k in ("running", "ready", "url", "model")})
        engine_url = server.url
    else:
        report["engine_url"] = engine_url
    report.update({"proxy_" + k: v for k, v in _proxy_service(settings, engine_url).status().items()})
    report["proxy_url"] = ProxySettings().public_url
    report.update({"processors_" + k: v for k, v in _processors_service(settings).status().items()})
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
