"""`rollwire gateway-node`: run one gateway node in the foreground until SIGTERM/SIGINT.

The first SIGTERM or SIGINT drains the node (finish the claimed sessions, take no new ones, commit, leave
the group); a second one cancels what still runs. Settings: ``ROLLWIRE_GATEWAY_*``
(:class:`producers.gateway.settings.GatewaySettings`) and Kafka's ``ROLLWIRE_*``; the options below
override them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any

import typer
import uvicorn

from producers.gateway.settings import GatewaySettings
from schemas.transport.settings import KafkaSettings


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the node's handlers decide when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_node(settings: GatewaySettings, kafka: KafkaSettings) -> None:
    """Run a node (and its HTTP endpoint unless the port is 0) until it has drained."""
    from producers.gateway.control import create_app
    from producers.gateway.node import GatewayNode

    node = GatewayNode(settings, kafka)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.drain)
    server: _Server | None = None
    server_task: asyncio.Task[None] | None = None
    if settings.port:
        server = _Server(uvicorn.Config(create_app(node), host=settings.host, port=settings.port,
                                        log_level="warning", access_log=False, lifespan="off"))
        server_task = asyncio.create_task(server.serve(), name="gateway-http")
    try:
        await node.run()
    finally:
        if server is not None and server_task is not None:
            server.should_exit = True
            await server_task


def gateway_node(
        proxy_url: str = typer.Option(None, help="Proxy base URL (ROLLWIRE_GATEWAY_PROXY_URL)."),
        run_slots: int = typer.Option(None, help="Harness runs at once (ROLLWIRE_GATEWAY_RUN_SLOTS)."),
        init_workers: int = typer.Option(None, help="Runtime inits at once (ROLLWIRE_GATEWAY_INIT_WORKERS)."),
        post_workers: int = typer.Option(None, help="Post-runs at once (ROLLWIRE_GATEWAY_POST_WORKERS)."),
        prewarm: int = typer.Option(None, help="Runtimes initialized ahead of free run slots "
                                               "(ROLLWIRE_GATEWAY_PREWARM)."),
        node_name: str = typer.Option(None, help="This node's name (ROLLWIRE_GATEWAY_NODE_NAME)."),
        port: int = typer.Option(None, help="HTTP port for health and cancel, 0 for none (ROLLWIRE_GATEWAY_PORT).")
) -> None:
    """Run a gateway node: take sessions from Kafka and run their harnesses."""
    given = {"proxy_url": proxy_url, "run_slots": run_slots, "init_workers": init_workers,
             "post_workers": post_workers, "prewarm": prewarm, "node_name": node_name, "port": port}
    overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    settings = GatewaySettings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_node(settings, KafkaSettings()))


def main() -> None:
    typer.run(gateway_node)


if __name__ == "__main__":
    main()
