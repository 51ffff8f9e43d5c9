"""The proxy's HTTP server: uvicorn, told about its own shutdown before it cuts the calls in flight.

On SIGTERM or SIGINT uvicorn stops accepting, lets the calls in flight run for the shutdown grace
(``ROLLWIRE_PROXY_SHUTDOWN_GRACE_S``), cancels what is left, and then runs the app's lifespan shutdown.
:class:`ProxyServer` marks the call service as stopping first, so that a call cut there is recorded as
``proxy_stopped`` rather than as a harness that hung up; the lifespan then waits for those records
(:meth:`proxy.calls.CallService.drain`) before it closes the Kafka producer.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI


class ProxyServer(uvicorn.Server):
    """uvicorn's server for the proxy app ``app``."""

    def __init__(self, config: uvicorn.Config, app: "FastAPI") -> None:
        super().__init__(config)
        self.proxy_app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(self.proxy_app.state, "proxy", None)
        if state is not None:  # None: the lifespan never started
            state.service.begin_stop()
        await super().shutdown(sockets)


def proxy_server(app: "FastAPI", host: str, port: int, shutdown_grace_s: int) -> ProxyServer:
    """The server for ``app`` on ``host:port`` (uvloop and httptools when installed, as they are here)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=shutdown_grace_s)
    return ProxyServer(config, app)
