"""The `rollwire` command: gathers the subcommands each package defines and manages the local stack.

``rollwire up`` brings up, in order: the project's Apache Kafka (KRaft, one node; ``--brokers 3``: a
three-node cluster on this machine, topics replicated three times with two in sync) and its topics, the
embedded engine (the real vLLM CPU build over the tiny local model; ``--engines N``: N of them on
consecutive ports, served by the proxy as one pool) unless ``ROLLWIRE_ENGINE_URLS`` or ``ROLLWIRE_ENGINE_URL``
names other engines, the gateway proxy (``--proxies N``: N proxy processes behind HAProxy on the proxy's
address, deploy/proxy_front.py), a trajectory worker (processors) and the web page (``rollwire ui``).
``rollwire down`` stops them; ``rollwire status`` reports them, every engine of the pool (its health, and
what the proxy's ``/v1/engines`` says of it) and every process of the proxy tier. The embedded engines ``up``
started are recorded in ``$ROLLWIRE_HOME/engine-pool`` (one ``NAME=URL`` a line) and a proxy tier in
``$ROLLWIRE_HOME/proxy-tier.json``, which is how ``status`` and ``down`` know them.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deploy import stack
from deploy.config import show_config
from deploy.engine.server import VllmServer
from deploy.errors import DeployError
from deploy.kafka import KafkaBroker, KafkaConfig
from deploy.kafka_cluster import KafkaCluster
from deploy.proxy_front import run_front
from deploy.services import ServiceProcess
from deploy.settings import ProxyTierSettings, load
from processors.evaluators.cli import app as evaluator_app
from processors.groups.cli import run as groups_run
from processors.trajectories.cli import rebuild as processors_rebuild
from processors.trajectories.cli import run as processors_run
from processors.trajectories.settings import ProcessorSettings
from producers.gateway.cli import gateway_node
from producers.rollout.cli import rollout_server, submit
from proxy.cli import run as proxy_run
from proxy.cli import session_app
from proxy.settings import ProxySettings
from schemas import paths
from schemas.admin_token import admin_token
from schemas.cli import app as schemas_app
from schemas.transport.admin import broker_answers
from schemas.transport.errors import TransportError
from sinks.export import export_sft
from sinks.ui.cli import run_ui

app = typer.Typer(help="rollwire: record coding-agent harnesses token for token, as RL training data.",
                  no_args_is_help=True, add_completion=False)
app.add_typer(schemas_app, name="schemas")
app.add_typer(session_app, name="session")
app.add_typer(evaluator_app, name="evaluator")
docker_app = typer.Typer(help="The Docker engine the docker runtime uses: adopt one that answers, or start "
                              "rollwire's own dockerd (deploy/docker_engine.py).", no_args_is_help=True)
images_app = typer.Typer(help="The container images sessions run in, built offline (deploy/images.py).",
                         no_args_is_help=True)
app.add_typer(docker_app, name="docker")
app.add_typer(images_app, name="images")
app.command("proxy", help="Run the gateway proxy in the foreground.")(proxy_run)
app.command("processors", help="Run a trajectory worker (Faust) in the foreground.")(processors_run)
app.command("groups", help="Run a groups worker (Faust): trajectories + evaluations -> GRPO groups.")(groups_run)
app.command("rebuild", help="Re-derive trajectories from the log with a builder, to a topic.")(processors_rebuild)
app.command("export-sft", help="Build the SFT dataset (JSONL, Parquet, acceptance stats) from the log.")(export_sft)
app.command("gateway-node", help="Run a gateway node (sessions → harness runs) in the foreground.")(gateway_node)
app.command("rollout-server", help="Run the rollout server in the foreground.")(rollout_server)
app.command("submit", help="Submit a tasks file (JSON Lines) to the rollout server.")(submit)
app.command("config", help="Print every ROLLWIRE_* variable: default, value here, meaning.")(show_config)
app.command("ui", help="Serve the read-only web page (runs, sessions, traces) built from the topics.")(run_ui)
app.command("proxy-front", help="Run HAProxy in front of several proxy processes, in the foreground "
                                "(`up --proxies N` starts it).")(run_front)


def _proxy_port() -> stack.Port:
    settings = ProxySettings()
    return stack.Port(settings.proxy_host, settings.proxy_port)


def _processors_port() -> stack.Port:
    settings = ProcessorSettings()
    return stack.Port(settings.host, settings.port)


def _stopper(name: str, where: stack.Port) -> ServiceProcess:
    """The pid-file handle of a service `rollwire up` started (for down and status)."""
    return ServiceProcess(name=name, args=(), health_url=f"http://{where.host}:{where.port}/health")


def _fail(exc: DeployError | TransportError) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.command()
def up(timeout_s: float = typer.Option(1800.0, help="How long to wait for each part (the first engine "
                                                    "start installs vLLM)."),
       engine: bool = typer.Option(True, help="Start the embedded engine (ignored with ROLLWIRE_ENGINE_URL)."),
       engines: int = typer.Option(None, "--engines", min=1, max=64, help=(
           "Embedded vLLM engines to run, on ROLLWIRE_ENGINE_PORT and the ports after it, all served by the "
           "proxy as one pool (ROLLWIRE_ENGINE_URLS engine-0=..., engine-1=...). The tiny model on two cores "
           "fits two or three. Default: ROLLWIRE_ENGINE_COUNT, else one.")),
       proxy: bool = typer.Option(True, help="Start the gateway proxy."),
       proxies: int = typer.Option(None, "--proxies", min=1, max=32, help=(
           "Proxy processes to run: with more than one, each on its own port (ROLLWIRE_PROXY_TIER_PORT and "
           "after), HAProxy in front of them on ROLLWIRE_PROXY_PORT (a session's calls to one process; needs "
           "`apt-get install -y haproxy`), its stats on ROLLWIRE_PROXY_STATS_PORT. Default: "
           "ROLLWIRE_PROXY_COUNT, else one.")),
       processors: bool = typer.Option(True, help="Start a trajectory worker."),
       ui: bool = typer.Option(True, help="Start the web page (rollwire ui) on ROLLWIRE_UI_PORT (8790)."),
       brokers: int = typer.Option(None, "--brokers", envvar="ROLLWIRE_KAFKA_BROKERS", min=1, max=9, help=(
           "Run the project's Kafka as a cluster of this many KRaft nodes on this machine (node i on "
           "ROLLWIRE_KAFKA_PORT + 2(i-1)); 3 or more: topics with 3 replicas, 2 in sync. Default: the "
           "cluster a previous `up --brokers` laid out, else one node.")),
       harness: list[str] = typer.Option([], "--harness", help=(
           "Install this harness CLI (qwen-code, pi, codex, claude-code, gemini-cli, opencode) first, with "
           "npm's progress here; repeat for several. The main job installs the harnesses its tasks name "
           "itself."))) -> None:
    """Start the local stack (Kafka and topics, engine, proxy, processors) and print its status."""
    config = KafkaConfig.from_env()
    try:
        if harness:
            stack.harnesses(harness, say=lambda line: typer.echo(line, err=True))
        cluster = stack.local_cluster(config, brokers)
        settings = stack.managed_settings(config, cluster=cluster)
        stack.broker(config, settings.kafka_bootstrap, brokers=brokers, timeout_s=min(timeout_s, 300))
        typer.echo(f"topics_created={len(stack.topics(settings).created)}")
        if processors:
            stack.processors(settings, _processors_port(), timeout_s=min(timeout_s, 120))
        external = stack.external_engines()
        pool: list[stack.Part] = []
        if external is not None or engine:
            configs = stack.engine_configs(_engine_count(engines))
            pool = stack.engines(external, configs, timeout_s=timeout_s)
            if external is None:
                stack.write_pool_record([stack.EngineEntry(part.name, part.address) for part in pool])
        if proxy and pool:
            served = stack.proxy_tier(settings, pool if len(pool) > 1 or external is None else pool[0].address,
                                      _proxy_port(), _tier_settings(proxies))
            _warn_if_pool_differs(served.entry, pool)
        if ui:
            stack.ui(settings, stack.ui_port())
    except (DeployError, TransportError) as exc:
        _fail(exc)
    status(as_json=False)


def _tier_settings(proxies: int | None) -> ProxyTierSettings:
    """ROLLWIRE_PROXY_* of the tier, with ``--proxies`` for its count when given."""
    settings = load(ProxyTierSettings)
    return settings if proxies is None else settings.model_copy(update={"count": proxies})


def _engine_count(engines: int | None) -> int:
    """``--engines``, else ROLLWIRE_ENGINE_COUNT (1)."""
    from deploy.settings import EngineServerSettings, load

    return engines if engines is not None else load(EngineServerSettings).count


def _warn_if_pool_differs(served: stack.Part, pool: list[stack.Part]) -> None:
    """A proxy that was already running serves the engines it was started with: say so when its
    ``/v1/engines`` lists others than this pool."""
    if served.started:
        return
    states = stack.engine_states([stack.EngineEntry(p.name, p.address) for p in pool], served.address,
                                 admin_token())
    missing = [state["id"] for state in states if not any(key.startswith("proxy_") for key in state)]
    if missing and len(pool) > 1:
        typer.secho(f"warning: the proxy at {served.address} was already running and does not list "
                    f"{', '.join(map(str, missing))}; `rollwire down` then `rollwire up --engines {len(pool)}` "
                    "restarts it over the whole pool", fg=typer.colors.YELLOW, err=True)


@app.command()
def down() -> None:
    """Stop the local stack (proxy or proxy tier, processors, embedded engine, Kafka)."""
    config = KafkaConfig.from_env()
    try:
        front, members = stack.tier_services()
        if members or front.pid() is not None:
            front.stop()  # first: no call reaches a process being stopped
            typer.echo(f"{front.name}=stopped")
            for member in members:
                member.stop()
                typer.echo(f"{member.name}=stopped")
        stack.forget_tier()
        _stopper("proxy", _proxy_port()).stop()
        typer.echo("proxy=stopped")
        _stopper("processors", _processors_port()).stop()
        typer.echo("processors=stopped")
        _stopper("ui", stack.ui_port()).stop()
        typer.echo("ui=stopped")
        if stack.external_engines() is None:
            configs = stack.recorded_engine_configs()
            for index, engine_config in enumerate(configs):
                VllmServer(engine_config).stop()
                typer.echo(f"engine={'stopped' if len(configs) == 1 else f'{stack.engine_name(index)} stopped'}")
        cluster = KafkaCluster.load(config)
        if cluster is not None:
            cluster.stop()
        KafkaBroker(config).stop()
    except DeployError as exc:
        _fail(exc)
    typer.echo("kafka=stopped")


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Report the local stack: broker, engine, proxy and processors, and whether each answers."""
    config = KafkaConfig.from_env()
    cluster = KafkaCluster.load(config)
    settings = stack.managed_settings(config, cluster=cluster)
    managed = settings.kafka_bootstrap in (config.bootstrap, cluster.bootstrap if cluster else None)
    report: dict[str, object] = {"kafka_managed": managed}
    if managed and cluster is not None:
        cluster_status = cluster.status()
        report.update({"kafka_" + k: v for k, v in cluster_status.items() if k != "nodes"})
        for node in cluster_status["nodes"]:
            report.update({f"kafka_node{node['node_id']}_{k}": v for k, v in node.items() if k != "node_id"})
    elif managed:
        report.update({"kafka_" + k: v for k, v in KafkaBroker(config).status().items()})
    report["kafka_bootstrap"] = settings.kafka_bootstrap
    report["kafka_answers"] = broker_answers(settings.kafka_bootstrap)
    report["topic_prefix"] = settings.topic_prefix
    try:
        external = stack.external_engines()
    except DeployError as exc:
        _fail(exc)
    tier = stack.read_tier_record()
    if tier is None:
        proxy_status = _stopper("proxy", _proxy_port()).status()
        proxy_url = ProxySettings().public_url
    else:
        front, members = stack.tier_services()
        proxy_status = front.status()
        proxy_url = ProxySettings().proxy_public_url or tier.url
    if external is None:
        configs = stack.recorded_engine_configs()
        for index, engine_config in enumerate(configs):
            prefix = "engine_" if len(configs) == 1 else f"engine{index}_"
            server_state = VllmServer(engine_config).status()
            report.update({prefix + k: v for k, v in server_state.items() if k in ("running", "ready", "url", "model")})
        entries = [stack.EngineEntry(stack.engine_name(i), c.url) for i, c in enumerate(configs)]
    else:
        entries = external
        if len(external) == 1:
            report["engine_url"] = external[0].url
    if len(entries) > 1:
        report["engines"] = len(entries)
        states = stack.engine_states(entries, proxy_url if proxy_status["healthy"] else None, admin_token())
        for index, state in enumerate(states):
            report.update({f"engine{index}_{k}": v for k, v in state.items() if k != "url" or external})
    if tier is None:
        report.update({"proxy_" + k: v for k, v in proxy_status.items()})
    else:
        report["proxies"] = len(members)
        for index, member in enumerate(members):
            report.update({f"proxy{index}_{k}": v for k, v in member.status().items()})
            report[f"proxy{index}_name"] = member.name
        report.update({"proxy_front_" + k: v for k, v in proxy_status.items()})
        report["proxy_front_stats_url"] = tier.stats_url
    report["proxy_url"] = proxy_url
    report.update({"processors_" + k: v for k, v in _stopper("processors", _processors_port()).status().items()})
    report.update({"ui_" + k: v for k, v in _stopper("ui", stack.ui_port()).status().items()})
    if as_json:
        typer.echo(json.dumps(report, default=str))
        return
    for name, value in report.items():
        typer.echo(f"{name}={value}")
    if not report["kafka_answers"]:
        raise typer.Exit(code=3)


@app.command()
def rollout(tasks_file: Path = typer.Argument(..., exists=True, help=(
                "JSON Lines, one TaskRequest a line; with --format swebench, SWE-bench / SWE-Gym instances; "
                "with --format harbor, a folder of Harbor task folders.")),
            harness: str = typer.Option(None, help="Run every task with this harness (codex, claude-code, "
                                                   "qwen-code, pi, gemini-cli, opencode, command)."),
            file_format: str = typer.Option("tasks", "--format", help=(
                "'tasks' (TaskRequest JSON Lines), 'swebench' (instances, each run in its image and graded "
                "by the swebench evaluator in a fresh container) or 'harbor' (Harbor task folders, each run in "
                "its environment image, built here, and scored by its verifier in a fresh container).")),
            oracle: bool = typer.Option(False, "--oracle", help="--format harbor: run each task's "
                                        "solution/solve.sh instead of a harness (checks a task set: every "
                                        "reward should be 1)."),
            runtime: str = typer.Option(None, help="Run every task in this runtime: 'local' or 'docker' (a "
                                                   "container per session; the Docker engine and the images "
                                                   "are brought up first)."),
            max_tokens: int = typer.Option(None, min=1, help="--format swebench: each reply's engine.max_tokens "
                                                             "(instances carry none; a random model needs a cap)."),
            samples: int = typer.Option(None, min=1, help="Sessions per task (overrides num_samples)."),
            timeout_s: float = typer.Option(None, help="Give up waiting after this long (default: the longest "
                                                       "task timeout plus 5 minutes)."),
            proxy_port: int = typer.Option(None, help="Port for a proxy the job starts (default "
                                                      "ROLLWIRE_PROXY_PORT, else a free one if that is taken)."),
            server_port: int = typer.Option(None, help="Port for a rollout server the job starts (default "
                                                       "ROLLWIRE_ROLLOUT_PORT, else a free one if taken)."),
            keep_services: bool = typer.Option(False, help="Leave the gateway node, evaluator and rollout "
                                                           "server the job started running afterwards."),
            live: bool = typer.Option(True, help="Show live progress (off: one line per change)."),
            engines: int = typer.Option(None, "--engines", min=1, max=64, help=(
                "Embedded vLLM engines to bring up for the job (see `rollwire up --engines`); default "
                "ROLLWIRE_ENGINE_COUNT, else one. Running engines are reused.")),
            proxies: int = typer.Option(None, "--proxies", min=1, max=32, help=(
                "Proxy processes behind HAProxy for the job (see `rollwire up --proxies`); default "
                "ROLLWIRE_PROXY_COUNT, else one. A running proxy (or tier of that size) is reused."))) -> None:
    """Run a tasks file end to end: bring up whatever is not running, run the tasks' sessions with live
    progress, print a summary."""
    from deploy.job import JobOptions, run_job

    if file_format not in ("tasks", "swebench", "harbor") or runtime not in (None, "local", "docker"):
        typer.secho("--format is 'tasks', 'swebench' or 'harbor'; --runtime is 'local' or 'docker'",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    if oracle and file_format != "harbor":
        typer.secho("--oracle needs --format harbor", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    if (file_format == "harbor") != tasks_file.is_dir():
        typer.secho("--format harbor reads a folder; the other formats a file", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    options = JobOptions(tasks_file=tasks_file, harness=harness, samples=samples, timeout_s=timeout_s,
                         proxy_port=proxy_port, server_port=server_port, keep_services=keep_services,
                         live=live, file_format="harbor" if file_format == "harbor" else
                         "swebench" if file_format == "swebench" else "tasks", oracle=oracle,
                         runtime=runtime, max_tokens=max_tokens, engines=_engine_count(engines),
                         proxies=_tier_settings(proxies).count)
    raise typer.Exit(code=run_job(options))


@app.command()
def train(proxy_url: str = typer.Option(None, help="The proxy whose engine gets the new weights (POST "
                                                   "/v1/policy/weights). Default: ROLLWIRE_PROXY_PUBLIC_URL, "
                                                   "else ROLLWIRE_PROXY_HOST:ROLLWIRE_PROXY_PORT."),
          group_size: int = typer.Option(8, min=1, help="Samples per task the trainer expects (the tasks' "
                                                        "num_samples). A step's batch holds --groups-per-step "
                                                        "whole groups, its token budget sized as groups x this "
                                                        "x --max-seq-tokens; a group with fewer trainable "
                                                        "samples (failed sessions left out) is trained on and "
                                                        "counted as short."),
          groups_per_step: int = typer.Option(1, min=1, help="Groups per batch (= per optimizer step and "
                                                             "weight push); a partial batch goes after 2 s."),
          max_seq_tokens: int = typer.Option(2048, min=1, help="Expected tokens per trace, for the budget."),
          lr: float = typer.Option(1e-4, help="AdamW learning rate."),
          temperature: float = typer.Option(1.0, help="The sessions' sampling temperature: the loss uses "
                                                      "logits / this, as the engine's processed logprobs do."),
          max_staleness: int = typer.Option(None, min=0, help="Train only on groups sampled at most this "
                                                              "many policy versions ago (default: any)."),
          stale: str = typer.Option("drop", help="What to do with staler groups: drop or downweight."),
          steps: int = typer.Option(10, min=1, help="Optimizer steps (= weight pushes) before exiting."),
          model: Path = typer.Option(None, help="Hugging Face model folder to start from (default: the "
                                                "embedded engine's tiny model)."),
          out: Path = typer.Option(None, help="Checkpoints folder (default $ROLLWIRE_HOME/trainer/<group id>); "
                                              "the engine must be able to read it."),
          group_id: str = typer.Option("rollwire-trainer", help="The trainer's consumer group: a restarted "
                                                                "trainer resumes after its last acked batch."),
          idle_timeout_s: float = typer.Option(None, help="Exit when no group came for this long (default: "
                                                          "wait)."),
          keep_checkpoints: int = typer.Option(2, min=1, help="Checkpoint folders to keep.")) -> None:
    """The reference online GRPO trainer (sinks/trainer.py): groups from `groups`, a GRPO step, the
    weights pushed through the proxy into the engine, --steps times; one line per step."""
    import os

    from sinks.trainer import OnlineTrainer, TrainerConfig, TrainerError, summary_line

    if stale not in ("drop", "downweight"):
        raise typer.BadParameter("must be drop or downweight", param_hint="--stale")
    home = paths.home()
    config = TrainerConfig(
        proxy_url=proxy_url or ProxySettings().public_url, model=model or stack.engine_config().model_dir,
        out=out or home / "trainer" / group_id, group_id=group_id, group_size=group_size,
        groups_per_step=groups_per_step, max_seq_tokens=max_seq_tokens, lr=lr, steps=steps,
        max_staleness=max_staleness, stale="downweight" if stale == "downweight" else "drop",
        temperature=temperature, idle_timeout_s=idle_timeout_s, keep_checkpoints=keep_checkpoints)
    try:
        reports = OnlineTrainer(config).run()
    except TrainerError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None
    typer.echo(summary_line(reports))
    if len(reports) < steps:
        raise typer.Exit(code=3)


@docker_app.command("up")
def docker_up(timeout_s: float = typer.Option(30.0, help="How long to wait for a started dockerd to answer.")) -> None:
    """Find an engine that answers ($DOCKER_HOST, /var/run/docker.sock, rollwire's own socket) or start
    rollwire's own dockerd (needs `apt-get install -y docker.io`); print the DOCKER_HOST to export."""
    from deploy.docker_engine import ensure_engine

    try:
        typer.echo(f"DOCKER_HOST={ensure_engine(timeout_s=timeout_s)}")
    except DeployError as exc:
        _fail(exc)


@docker_app.command("down")
def docker_down() -> None:
    """Stop the dockerd rollwire started (never an engine it did not start)."""
    from deploy.docker_engine import stop_engine

    try:
        typer.echo("docker=stopped" if stop_engine() else "docker=not running (rollwire's own)")
    except DeployError as exc:
        _fail(exc)


@docker_app.command("status")
def docker_status(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Which engine answers, its version, data root, containers and images; exit 3 when none answers."""
    from deploy.docker_engine import engine_status

    report = engine_status()
    if as_json:
        typer.echo(json.dumps(report, default=str))
    else:
        for name, value in report.items():
            typer.echo(f"{name}={value}")
    if not report["answers"]:
        raise typer.Exit(code=3)


@docker_app.command("reap")
def docker_reap(all_sessions: bool = typer.Option(False, "--all", help="Remove every session container "
                                                                       "(rollwire.session label), not only "
                                                                       "those whose creator died."),
                older_than_s: float = typer.Option(0.0, help="With --all: only containers created longer ago.")) -> None:
    """Remove session containers left behind: by default this host's whose creating process is gone."""
    from deploy.docker_engine import client_for, ensure_engine, reap_containers
    from producers.runtimes.reaper import reap_orphans

    try:
        url = ensure_engine()
        if all_sessions:
            names = [c.name for c in reap_containers(url, older_than_s=older_than_s)]
        else:
            client = client_for(url)
            try:
                names = reap_orphans(client)
            finally:
                client.close()
    except DeployError as exc:
        _fail(exc)
    for name in names:
        typer.echo(f"removed {name}")
    typer.echo(f"reaped={len(names)}")


_IMAGES_HELP = """Build rollwire's images offline, each only when its inputs changed: rollwire/base:bookworm
(debootstrap --variant=minbase bookworm with git, python3, python3-pytest, patch, ...; this machine's Node
20 at /usr/local/bin/node), rollwire/harnesses:latest (the pinned harness CLIs at their harness-cache
path) and one rollwire/swe-<instance>:latest per SWE-style instance (repository at /testbed, committed
at base_commit).

Needs a Docker engine (adopted, or rollwire's own dockerd started: apt-get install -y docker.io),
debootstrap (apt-get install -y debootstrap), root, the Debian mirror named by this machine's apt
sources (default http://deb.debian.org/debian) and Node.js 20+ at /usr/bin/node. A cold base is mostly
debootstrap's time (its root tarball is then cached under $ROLLWIRE_CACHE_DIR/images); images whose
inputs did not change are not rebuilt."""


@images_app.command("build", help=_IMAGES_HELP,
                    short_help="Build rollwire's base, harness and SWE instance images offline (cached).")
def images_build(swebench: Path = typer.Option(None, "--swebench", exists=True, dir_okay=False,
                                               help="Instances file (JSON Lines or array) whose instances get "
                                                    "an image; repositories at <its folder>/repos/<id>/. "
                                                    "Default: examples/swebench/instances.jsonl if present."),
                 no_swebench: bool = typer.Option(False, "--no-swebench", help="Build only base and harnesses."),
                 force: bool = typer.Option(False, "--force", help="Rebuild even the images that are up to date.")) -> None:
    from deploy.images import DEFAULT_INSTANCES, build_images

    instances = None if no_swebench else swebench or (DEFAULT_INSTANCES if DEFAULT_INSTANCES.is_file() else None)
    try:
        build_images(instances, force=force, say=typer.echo)
    except DeployError as exc:
        _fail(exc)


@images_app.command("list")
def images_list(swebench: Path = typer.Option(None, "--swebench", exists=True, dir_okay=False,
                                              help="Instances file to compare the swe images with (default: "
                                                   "examples/swebench/instances.jsonl if present)."),
                as_json: bool = typer.Option(False, "--json", help="One JSON object per line.")) -> None:
    """The engine's rollwire/* images: size, created, and whether each is up to date with its inputs."""
    from dataclasses import asdict

    from deploy.images import DEFAULT_INSTANCES, list_images

    instances = swebench or (DEFAULT_INSTANCES if DEFAULT_INSTANCES.is_file() else None)
    try:
        rows = list_images(instances)
    except DeployError as exc:
        _fail(exc)
    for row in rows:
        if as_json:
            typer.echo(json.dumps(asdict(row)))
            continue
        state = {True: "up to date", False: "outdated", None: "-"}[row.up_to_date]
        typer.echo(f"{row.image:<48} {row.image_id:<20} {row.size_bytes / 1e6:>8.0f} MB  {row.created}  {state}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
