"""The main job, ``rollwire rollout tasks.jsonl --harness H --samples N``: bring up what is not running,
submit the tasks, show live progress, and end with a summary table and where the outputs are.

``--format swebench`` reads SWE-bench / SWE-Gym instances instead of TaskRequests (each a docker task in
its instance image, graded by the ``swebench`` evaluator); ``--format harbor`` a folder of Harbor tasks
(each a docker task in its environment image, built before the sessions start by deploy/task_images.py,
scored by the ``harbor`` evaluator; ``--oracle`` runs their solutions); ``--runtime docker`` runs every task's sessions
in containers (a tasks-file task without an image gets ``rollwire/harnesses:latest``, its repository
checked out here and mounted). When any task runs in docker the Docker engine and the images are brought
up first (``stack.docker``).

What it brings up, in order, each only if nothing answers where it should already: the Kafka broker and
its topics, the engine (embedded vLLM CPU, or ``ROLLWIRE_ENGINE_URL``), the proxy (``--proxies N``: N
processes behind HAProxy on the proxy's address, ``stack.proxy_tier``), a trajectory worker
(processors), the rollout server, a gateway node (``rollwire gateway-node``), for each evaluator the
tasks name ``rollwire evaluator run NAME``, and the groups worker (``rollwire groups``), each through
its routine in deploy/stack.py. A configured port that something else holds is replaced by a
free one (ports: ``--proxy-port``, ``--server-port``, ``ROLLWIRE_PROCESSORS_PORT``,
``ROLLWIRE_GATEWAY_PORT``, ``ROLLWIRE_GROUPS_PORT``).

After the sessions end (and their trajectories and evaluations are in), the job reads this run's groups
from `groups` (waiting up to ``GROUP_WAIT_S`` for those whose samples are all in) and runs the SFT store
over this run's sessions into ``$ROLLWIRE_HOME/runs/<run id>/sft/`` (``sft.jsonl``, ``sft.parquet``,
``decisions.jsonl``, ``stats.json``; accepted = the tasks' evaluator's reward at or above
``SFT_MIN_REWARD``). It prints rewards per session, the groups with their advantages, the acceptance
rate, and where the outputs are.

Afterwards the base stack (broker, engine, proxy, processors) keeps running, as after ``rollwire up``
(``rollwire down`` stops it); the rollout server, gateway node, evaluators and groups worker that the job
started are stopped unless ``--keep-services``.

Task ids get a per-run suffix (``{task_id}-r{run}``) so that a tasks file can be run again (a task id is
accepted once). Sessions that fail for the infrastructure are resubmitted by the rollout
server (ROLLWIRE_ROLLOUT_MAX_RETRIES); the summary counts the resubmissions and lists the sessions they
replaced. Exit code: 0 when every sample's latest session ended and none failed for infrastructure (or
unknown) reasons; 1 when some did (or had not ended when the job gave up waiting); 2 when the stack could not be brought
up, or a task line was bad or refused.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live

from deploy import stack
from deploy.errors import DeployError
from deploy.images import DEFAULT_INSTANCES, HARNESS_IMAGE
from deploy.job_results import collect
from deploy.task_images import build_task_images, task_builds
from deploy.kafka import KafkaConfig
from deploy.settings import ProxyTierSettings, load
from processors.groups.settings import GroupSettings
from processors.trajectories.settings import ProcessorSettings
from producers.gateway.settings import GatewaySettings
from producers.rollout.display import (
    pages,
    acceptance_line,
    failures_table,
    groups_table,
    outputs,
    progress_line,
    progress_table,
    sessions_table,
    summary_table,
)
from producers.rollout.settings import RolloutServerSettings
from producers.rollout.taskfile import BadLine, Overrides, TaskFormat, TaskLine, load_tasks, post_task
from proxy.settings import ProxySettings
from schemas import paths
from schemas.rollouts import TaskState, TaskStatus, TaskSubmitted
from schemas.sessions import FailureKind
from schemas.tasks import EngineParams, TaskRequest
from schemas.topics import Topic
from schemas.transport.settings import KafkaSettings
from sinks.sft import SftCriteria

POLL_S = 1.0
TRAJECTORY_WAIT_S = 120.0
"""After the tasks are done, how long to wait for trajectories of sessions that made model calls."""
GROUP_WAIT_S = 90.0
"""Then how long to wait for the groups of tasks whose samples all have their trajectory."""
SFT_MIN_REWARD = 1.0
"""The SFT store's acceptance threshold (the `tests` evaluator scores 1 for a pass)."""


@dataclass(frozen=True)
class JobOptions:
    tasks_file: Path
    harness: str | None = None
    samples: int | None = None
    timeout_s: float | None = None
    proxy_port: int | None = None
    server_port: int | None = None
    keep_services: bool = False
    live: bool = True
    file_format: TaskFormat = "tasks"
    runtime: str | None = None
    """Run every task in this runtime kind (``local`` or ``docker``) instead of its own."""
    max_tokens: int | None = None
    """engine.max_tokens for tasks that carry no engine parameters (SWE-bench instances)."""
    engines: int = 1
    """Embedded engines to bring up (``--engines``), served by the proxy as one pool."""
    proxies: int = 1
    """Proxy processes to bring up (``--proxies``); more than one run behind HAProxy."""
    oracle: bool = False
    """``--format harbor``: run each task's solution/solve.sh instead of a harness."""


# ---- the stack ----------------------------------------------------------------------------------------


@dataclass
class Stack:
    """Brings up the parts that are not running (deploy/stack.py); remembers what it started."""

    console: Console
    options: JobOptions
    kafka: KafkaSettings | None = None
    proxy_url: str = ""
    server_url: str = ""
    ui_url: str = ""
    started: list[stack.Part] = field(default_factory=list)
    """The job-specific parts this job started (rollout server, gateway node, evaluators, groups)."""
    names: set[str] = field(default_factory=set)
    """The parts that run (started or reused)."""

    def _say(self, part: str, state: str, detail: str = "") -> None:
        if state in ("reused", "started"):
            self.names.add(part)
        colour = {"reused": "cyan", "started": "green", "skipped": "yellow"}.get(state, "white")
        self.console.print(f"  {part:<16} [{colour}]{state}[/{colour}] {detail}")

    def _report(self, part: stack.Part, label: str | None = None) -> stack.Part:
        self._say(label or part.name, part.state, part.address)
        return part

    def _job_part(self, part: stack.Part, label: str | None = None) -> None:
        """A part that lives only as long as the job (unless --keep-services)."""
        self._report(part, label)
        if part.started:
            self.started.append(part)

    def up(self, evaluators: set[str], docker: bool = False, harnesses: set[str] | None = None,
           requests: Sequence[TaskRequest] = ()) -> None:
        self.console.print("[bold]stack[/bold]")
        if harnesses:
            # Before anything is submitted, in this output: a gateway node then finds each CLI installed
            # (and would only wait on this install's lock if it came first).
            self.console.print(f"  harnesses        checking {', '.join(sorted(harnesses))} (a first install "
                               "takes a few minutes)…")
            self._report(stack.harnesses(sorted(harnesses), say=lambda line: self.console.print(
                f"    {line}", highlight=False)))
        if docker:
            # The instance images of a SWE-bench file, else the shipped examples' (scripted tasks use them).
            instances = (self.options.tasks_file if self.options.file_format == "swebench"
                         else DEFAULT_INSTANCES if DEFAULT_INSTANCES.is_file() else None)
            self.console.print("  docker           checking the engine and the images (the first build "
                               "takes a few minutes)…")
            self._report(stack.docker(instances, say=lambda line: self.console.print(f"    {line}",
                                                                                     highlight=False)))
            if task_builds(requests):
                self.console.print("  task images      building the tasks' environments (Dockerfiles)…")
                build_task_images(requests, say=lambda line: self.console.print(f"    {line}", highlight=False))
        config = KafkaConfig.from_env()
        kafka = stack.managed_settings(config)
        self._report(stack.broker(config, kafka.kafka_bootstrap))
        self._report(stack.topics(kafka))
        self.kafka = kafka

        external = stack.external_engines()
        pool = stack.engines(
            external, stack.engine_configs(self.options.engines),
            on_start=lambda: self.console.print("  engines          starting (the first start installs vLLM's "
                                                "CPU build)…"))
        for part in pool:
            self._report(part, "engine" if len(pool) == 1 else part.name)
        if external is None:
            stack.write_pool_record([stack.EngineEntry(part.name, part.address) for part in pool])

        proxy_settings = ProxySettings()
        tier = stack.proxy_tier(
            kafka, pool if len(pool) > 1 or external is None else pool[0].address, stack.Port(
                proxy_settings.proxy_host, self.options.proxy_port or proxy_settings.proxy_port, move_if_taken=True),
            load(ProxyTierSettings).model_copy(update={"count": self.options.proxies}))
        for part in tier.parts:
            self._report(part, "proxy" if len(tier.parts) == 1 else part.name)
        # A public URL the user set is how harnesses reach the proxy; else its own address (the front's).
        self.proxy_url = proxy_settings.proxy_public_url or tier.entry.address

        worker = ProcessorSettings()
        self._report(stack.processors(kafka, stack.Port(worker.host, worker.port, move_if_taken=True)))
        try:  # the page is for looking: the run goes on without it
            where = stack.ui_port()
            self.ui_url = self._report(stack.ui(kafka, dataclasses.replace(where, move_if_taken=True))).address
        except DeployError as exc:
            self._say("ui", "skipped", f"it did not start: {exc}")

        rollout = RolloutServerSettings()
        server = stack.rollout_server(kafka, stack.Port(rollout.host, self.options.server_port or rollout.port,
                                                        move_if_taken=True))
        self.server_url = rollout.public_url or server.address
        self._job_part(server)

        gateway = GatewaySettings()
        gateway_port = stack.Port(gateway.host, gateway.port, move_if_taken=True) if gateway.port else None
        # The node asks one engine's health to name an outage as the cause of a failed run; behind a pool,
        # one engine down is the proxy's to route around, so no single engine is named.
        self._job_part(stack.gateway_node(kafka, self.proxy_url, gateway_port,
                                          engine_url=pool[0].address if len(pool) == 1 else None))
        # A judge with no endpoint of its own grades on the engine the job serves, called directly.
        judge_env = ({"ROLLWIRE_JUDGE_URL": pool[0].address} if not os.environ.get("ROLLWIRE_JUDGE_URL") else {})
        for name in sorted(evaluators):
            try:
                self._job_part(stack.evaluator(kafka, name, env=judge_env if name == "judge" else None),
                               f"evaluator {name}")
            except DeployError as exc:
                self._say(f"evaluator {name}", "skipped", f"it did not start: {exc}")
        grouping = GroupSettings()
        self._job_part(stack.groups(kafka, stack.Port(grouping.host, grouping.port, move_if_taken=True)))

    def stop_started(self) -> None:
        for part in reversed(self.started):
            assert part.stop is not None
            part.stop()
            self.console.print(f"  stopped {part.name}")


# ---- following the tasks ------------------------------------------------------------------------------


def _statuses(client: httpx.Client, server_url: str, task_ids: list[str]) -> list[TaskStatus]:
    out = []
    for task_id in task_ids:
        response = client.get(f"{server_url}/v1/tasks/{task_id}")
        response.raise_for_status()
        out.append(TaskStatus.model_validate(response.json()))
    return out


def _settled(statuses: list[TaskStatus], trajectory_deadline: float | None) -> bool:
    """All tasks done, and (until the deadline) every session that made model calls has its trajectory."""
    if not all(s.state == TaskState.DONE for s in statuses):
        return False
    if trajectory_deadline is not None and time.monotonic() < trajectory_deadline:
        return all(s.trajectory_id for t in statuses for s in t.sessions if s.completions)
    return True


def follow(console: Console, server_url: str, task_ids: list[str], timeout_s: float, live: bool) -> list[TaskStatus]:
    """Poll the tasks' status until they are done (or ``timeout_s``), showing progress."""
    started = time.monotonic()
    deadline = started + timeout_s
    trajectory_deadline: float | None = None
    statuses: list[TaskStatus] = []
    last_line = ""
    last_print = 0.0
    with httpx.Client(timeout=30) as client:
        display = Live(console=console, refresh_per_second=2, transient=False) if live and console.is_terminal else None
        if display is not None:
            display.start()
        try:
            while True:
                try:
                    statuses = _statuses(client, server_url, task_ids)
                except httpx.HTTPError as exc:
                    console.print(f"[yellow]rollout server did not answer ({exc}); retrying[/yellow]")
                    time.sleep(POLL_S)
                    if time.monotonic() > deadline:
                        break
                    continue
                elapsed = time.monotonic() - started
                if display is not None:
                    display.update(progress_table(statuses, elapsed))
                else:
                    line = progress_line(statuses, elapsed)
                    changed = line.split("]", 1)[1] != last_line.split("]", 1)[-1]
                    if changed or time.monotonic() - last_print > 30:
                        console.print(line, highlight=False)
                        last_line, last_print = line, time.monotonic()
                if trajectory_deadline is None and all(s.state == TaskState.DONE for s in statuses):
                    trajectory_deadline = time.monotonic() + TRAJECTORY_WAIT_S
                if _settled(statuses, trajectory_deadline) or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
        finally:
            if display is not None:
                display.stop()
    return statuses


def _home() -> Path:
    return paths.home()


def _sink_files(since: float) -> list[str]:
    """Files under $ROLLWIRE_HOME/sinks written during the run (the sinks' default output folder)."""
    root = _home() / "sinks"
    if not root.is_dir():
        return []
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and p.stat().st_mtime >= since)


def missing_trajectories(statuses: list[TaskStatus]) -> list[str]:
    """Sessions that ended after making model calls but have no trajectory (the processors did not
    build one)."""
    return [s.session_id for t in statuses for s in t.sessions if s.ended and s.completions and not s.trajectory_id]


def exit_code(statuses: list[TaskStatus]) -> int:
    """1 if any sample's latest session (after resubmissions) failed for infrastructure reasons or for
    reasons nobody could attribute, had not ended, or has model calls but no trajectory (an
    infrastructure failure downstream); else 0."""
    for status in statuses:
        for session in status.sessions:
            if not session.ended or session.failure in (FailureKind.INFRASTRUCTURE, FailureKind.UNKNOWN):
                return 1
    return 1 if missing_trajectories(statuses) else 0


def with_runtime(line: TaskLine, kind: str | None) -> TaskLine:
    """``line`` with its task's runtime kind replaced by ``kind`` (None: as it is). A task moved into
    docker without an image runs in the harness image; a task whose workspace lives in its image cannot
    leave docker."""
    runtime = line.request.runtime
    if kind is None or kind == runtime.kind:
        return line
    if kind == "local" and runtime.repo is None and runtime.image:
        raise ValueError(f"task {line.request.task_id}: its repository lives in the image {runtime.image}: it "
                         "runs only in docker")
    update: dict[str, object] = {"kind": kind}
    if kind == "docker" and not runtime.image:
        update["image"] = HARNESS_IMAGE
    request = line.request.model_copy(update={"runtime": runtime.model_copy(update=update)})
    return TaskLine(line.line_no, request, line.where)


def run_job(options: JobOptions, console: Console | None = None) -> int:
    """The whole job; returns the process exit code."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=200)  # logs and pipes: keep the tables' rows whole
    started_at = time.time()
    run_id = time.strftime("%m%d%H%M%S") + secrets.token_hex(1)
    engine = EngineParams(max_tokens=options.max_tokens) if options.max_tokens else None
    loaded, bad = load_tasks(options.tasks_file, Overrides(harness=options.harness, samples=options.samples,
                                                           task_id_suffix=f"r{run_id}", engine=engine,
                                                           oracle=options.oracle),
                             format=options.file_format)
    good: list[TaskLine] = []
    for line in loaded:
        try:
            good.append(with_runtime(line, options.runtime))
        except ValueError as exc:
            bad.append(BadLine(line.line_no, str(exc), line.where))
    for refused in bad:
        console.print(f"[red]{options.tasks_file}: {refused.label}: {refused.error}[/red]", highlight=False)
    if not good:
        console.print("[red]no task to run[/red]")
        return 2
    evaluators = {line.request.evaluator.name for line in good if line.request.evaluator is not None}
    docker = any(line.request.runtime.kind == "docker" for line in good)
    harnesses: set[str] = {line.request.agent.harness for line in good}
    running = Stack(console, options)
    try:
        try:
            running.up(evaluators, docker, harnesses, [line.request for line in good])
        except Exception as exc:  # noqa: BLE001 - any part failing to start ends the job with its reason
            console.print(f"[red]the stack did not come up: {exc}[/red]", highlight=False)
            return 2
        submitted: list[TaskSubmitted] = []
        with httpx.Client(timeout=30) as client:
            for line in good:
                try:
                    submitted.append(post_task(client, running.server_url, line.request))
                except (ValueError, httpx.HTTPError) as exc:
                    console.print(f"[red]{options.tasks_file}: {line.label}: refused: {exc}[/red]", highlight=False)
                    bad.append(BadLine(line.line_no, str(exc), line.where))
        if not submitted:
            return 2
        sessions = sum(len(s.session_ids) for s in submitted)
        harness = options.harness or "as in the tasks file"
        console.print(f"[bold]submitted[/bold] {len(submitted)} tasks, {sessions} sessions (harness {harness}) "
                      f"to {running.server_url}")
        timeout_s = options.timeout_s or max(line.request.timeout_s for line in good) + 300
        task_ids = [s.task_id for s in submitted]
        statuses = follow(console, running.server_url, task_ids, timeout_s, options.live)
        console.print(summary_table(statuses))
        failures = failures_table(statuses)
        if failures is not None:
            console.print(failures)
        assert running.kafka is not None
        evaluator_names = {s.evaluator for s in statuses}
        criteria = SftCriteria(min_reward=SFT_MIN_REWARD,
                               evaluator=evaluator_names.pop() if len(evaluator_names) == 1 else None)
        sft_dir = _home() / "runs" / run_id / "sft"
        expected = [t.task_id for t in statuses if t.sessions and all(s.trajectory_id for s in t.sessions)]
        console.print(f"reading this run's groups and building its SFT dataset in {sft_dir} …", highlight=False)
        try:
            groups, sft = collect(running.kafka, task_ids, [s.session_id for t in statuses for s in t.sessions],
                                  expected, GROUP_WAIT_S if "groups" in running.names else 0.0, sft_dir, criteria)
        except Exception as exc:  # noqa: BLE001 - the run's summary is still worth printing
            console.print(f"[red]reading groups / building the SFT dataset failed: {exc!r}[/red]", highlight=False)
            groups, sft = {}, {}
        console.print(sessions_table(statuses, groups))
        console.print(groups_table(statuses, groups))
        if sft:
            console.print(acceptance_line(sft))
        registry = running.kafka.registry()
        topics = {t.value: registry.name(t) for t in (Topic.TASKS, Topic.SESSIONS, Topic.SESSION_EVENTS,
                                                      Topic.COMPLETIONS, Topic.TRAJECTORIES, Topic.EVALUATIONS,
                                                      Topic.GROUPS)}
        files = [*sft.get("files", {}).values(), *_sink_files(started_at)]
        console.print(outputs(topics, running.server_url, task_ids, files))
        if running.ui_url:
            console.print(pages(running.ui_url, run_id, statuses))
        if running.started and not options.keep_services:
            console.print("  (the results are served while a rollout server runs: `rollwire rollout-server` "
                          "rebuilds them from the topics)", highlight=False)
        missing = missing_trajectories(statuses)
        if missing:
            console.print(f"[red]{len(missing)} sessions made model calls but have no trajectory after "
                          f"{TRAJECTORY_WAIT_S:.0f} s: is the processors worker healthy? "
                          f"(log: {_home() / 'processors' / 'processors.log'})[/red]", highlight=False)
        code = exit_code(statuses)
        if code == 0 and bad:
            code = 2
        console.print(f"wall time {time.time() - started_at:.0f} s, exit code {code}", highlight=False)
        return code
    finally:
        if not options.keep_services and running.started:
            running.stop_started()
