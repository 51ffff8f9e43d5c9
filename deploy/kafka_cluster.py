"""A Kafka cluster of several KRaft nodes on one machine, each a :class:`~deploy.kafka.KafkaBroker`.

Every node is a combined broker and controller with its own home (``<home>/node-<id>``: properties, data,
log, pid file), its own client and controller ports, and the same static controller quorum and cluster
id. ``rollwire up --brokers 3`` lays the nodes out from ``ROLLWIRE_KAFKA_PORT`` (node *i* listens on
``port + 2(i-1)``, its controller on the next port); tests and benchmarks pass free ports. The layout is
written to ``<home>/cluster.json`` on start, so that ``rollwire status``, ``down`` and later commands
find the cluster without being told its size again.

A cluster of three or more keeps three replicas of everything with two in sync (deploy/kafka.py sets
the brokers' defaults; :meth:`KafkaCluster.settings` gives the clients the same for the topics they
create). :meth:`KafkaCluster.kill` and :meth:`KafkaCluster.restart` take one node down hard and bring it
back: the failover tests and ``bench/failover.py`` use them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from deploy.errors import ConfigError
from deploy.kafka import KafkaBroker, KafkaConfig, new_cluster_id
from schemas.transport.admin import KafkaAdmin
from schemas.transport.errors import TransportError
from schemas.transport.settings import KafkaSettings

LAYOUT_FILE = "cluster.json"
MAX_BROKERS = 9


def node_configs(base: KafkaConfig, brokers: int, ports: Sequence[tuple[int, int]] | None = None,
                 cluster_id: str | None = None) -> list[KafkaConfig]:
    """The nodes' configurations: ``base``'s version, jars, host, heap and limits; node ids 1..brokers;
    ``ports`` (client, controller) per node, else two consecutive ports per node from ``base.port``."""
    if not 1 <= brokers <= MAX_BROKERS:
        raise ConfigError(f"a local cluster has 1 to {MAX_BROKERS} brokers, not {brokers}")
    if ports is None:
        ports = [(base.port + 2 * i, base.port + 2 * i + 1) for i in range(brokers)]
    if len(ports) != brokers:
        raise ConfigError(f"{brokers} brokers need {brokers} port pairs, not {len(ports)}")
    flat = [port for pair in ports for port in pair]
    if len(set(flat)) != len(flat):
        raise ConfigError(f"the nodes' ports must all differ: {list(ports)}")
    quorum = tuple(f"{i + 1}@{base.host}:{controller}" for i, (_, controller) in enumerate(ports))
    cluster = cluster_id or new_cluster_id()
    return [replace(base, home=base.home / f"node-{i + 1}", port=port, controller_port=controller,
                    node_id=i + 1, quorum=quorum, cluster_id=cluster)
            for i, (port, controller) in enumerate(ports)]


class KafkaCluster:
    """Start, stop, kill and inspect the nodes of a local multi-node cluster."""

    def __init__(self, base: KafkaConfig, brokers: int, ports: Sequence[tuple[int, int]] | None = None,
                 cluster_id: str | None = None) -> None:
        self.base = base
        self.nodes = [KafkaBroker(config) for config in node_configs(base, brokers, ports, cluster_id)]

    @classmethod
    def load(cls, base: KafkaConfig) -> KafkaCluster | None:
        """The cluster whose layout ``base.home`` holds (as a start wrote it), or None if there is none."""
        path = base.home / LAYOUT_FILE
        try:
            layout = json.loads(path.read_text(encoding="utf-8"))
            ports = [(int(node["port"]), int(node["controller_port"])) for node in layout["nodes"]]
            return cls(base, len(ports), ports, str(layout["cluster_id"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} is not a cluster layout rollwire wrote ({exc}); remove it (and the "
                              "node-* folders beside it) to start afresh") from exc

    @property
    def layout_file(self) -> Path:
        return self.base.home / LAYOUT_FILE

    @property
    def bootstrap(self) -> str:
        """Every node's client address, comma-separated: clients reach the cluster while any one is up."""
        return ",".join(node.config.bootstrap for node in self.nodes)

    @property
    def replicas(self) -> int:
        return self.nodes[0].config.replicas

    @property
    def min_insync_replicas(self) -> int:
        return self.nodes[0].config.min_insync_replicas

    def node(self, node_id: int) -> KafkaBroker:
        for node in self.nodes:
            if node.config.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id} in this cluster (nodes 1..{len(self.nodes)})")

    def settings(self, settings: KafkaSettings | None = None) -> KafkaSettings:
        """``settings`` (default: from the environment) pointed at this cluster, with its replication for the
        topics clients create, unless the environment set those explicitly."""
        settings = settings or KafkaSettings()
        update: dict[str, Any] = {}
        for name, value in (("kafka_bootstrap", self.bootstrap), ("replication_factor", self.replicas),
                            ("min_insync_replicas", self.min_insync_replicas)):
            if name not in settings.model_fields_set:
                update[name] = value
        return settings.model_copy(update=update)

    def start(self, timeout_s: float = 180) -> None:
        """Start every node that is not running, together (a quorum forms only once a majority is up);
        return once each answers Kafka requests. A node that fails stops the ones this call launched."""
        self.base.home.mkdir(parents=True, exist_ok=True)
        self._write_layout()
        waiting = [node for node in self.nodes if not node.is_running()]
        try:
            self._each(lambda node: node.start(timeout_s=timeout_s), self.nodes)
            # A node answers before the controller has registered (unfenced) it: until every one is,
            # creating a topic with as many replicas as nodes is refused.
            asyncio.run(self._await_registered(time.monotonic() + timeout_s))
        except BaseException:
            self._each(lambda node: node.stop(timeout_s=10), waiting, raise_first=False)
            raise

    async def _await_registered(self, deadline: float) -> None:
        wanted = sorted(node.config.node_id for node in self.nodes)
        seen: list[int] = []
        async with KafkaAdmin(self.bootstrap) as admin:
            while time.monotonic() < deadline:
                try:
                    seen = await admin.broker_ids()
                except TransportError:
                    seen = []
                if seen == wanted:
                    return
                await asyncio.sleep(0.3)
        raise ConfigError(f"the cluster's nodes {wanted} started but only {seen} registered in time; see the "
                          f"nodes' logs under {self.base.home}")

    def stop(self, timeout_s: float = 30) -> None:
        """Stop every node (SIGTERM, SIGKILL after ``timeout_s``); safe to repeat."""
        self._each(lambda node: node.stop(timeout_s=timeout_s), self.nodes)

    def kill(self, node_id: int) -> None:
        """SIGKILL one node: its partitions' leadership moves to the in-sync followers."""
        self.node(node_id).kill()

    def restart(self, node_id: int, timeout_s: float = 120) -> None:
        """Start a stopped or killed node again (same data, same ports); it rejoins and catches up."""
        self.node(node_id).start(timeout_s=timeout_s)

    def status(self) -> dict[str, Any]:
        """What ``rollwire status`` reports (no network request)."""
        nodes = [node.status() for node in self.nodes]
        return {"brokers": len(nodes), "running": sum(1 for n in nodes if n["running"]),
                "bootstrap": self.bootstrap, "replicas": self.replicas,
                "min_insync_replicas": self.min_insync_replicas, "nodes": nodes}

    def _write_layout(self) -> None:
        layout = {"cluster_id": self.nodes[0].config.cluster_id,
                  "nodes": [{"node_id": n.config.node_id, "port": n.config.port,
                             "controller_port": n.config.controller_port} for n in self.nodes]}
        self.layout_file.write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")

    @staticmethod
    def _each(action: Callable[[KafkaBroker], None], nodes: Sequence[KafkaBroker], raise_first: bool = True) -> None:
        """Run ``action`` on every node in parallel; re-raise the first failure once all have finished."""
        if not nodes:
            return
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            futures = [pool.submit(action, node) for node in nodes]
        first = next((error for error in (f.exception() for f in futures) if error is not None), None)
        if first is not None and raise_first:
            raise first
