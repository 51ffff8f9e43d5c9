"""The host side of the proxy relay: a session's Unix socket → the proxy's TCP address.

A container with no network (``RuntimeSpec.network == "relay"``) reaches the proxy through a Unix socket
in a directory bind-mounted into it; :mod:`producers.runtimes.container_relay` listens on 127.0.0.1
inside and forwards there. Here, one asyncio Unix-socket server per session forwards each connection
to the proxy's ``host:port``: bytes as they come, both directions, a half-close passed on as one, any
number of connections at once.

The target is set when the harness's URL is decided (:meth:`SocketRelay.target`), which may be after
the container started (pre-warm); a connection made before that is closed at once. Only that one
address is reachable through the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from producers.runtimes.container_relay import splice

SOCKET_NAME = "proxy.sock"
MAX_SOCKET_PATH = 100
"""sun_path holds 108 bytes; keep a margin."""


class SocketRelay:
    """One session's relay server on ``directory / SOCKET_NAME``."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / SOCKET_NAME
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path {self.path} is longer than {MAX_SOCKET_PATH} bytes")
        self._target: tuple[str, int] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.connections_total = 0

    @property
    def address(self) -> tuple[str, int] | None:
        return self._target

    def target(self, host: str, port: int) -> None:
        """Forward to ``host:port`` from now on; a session relays to one address only."""
        if self._target is not None and self._target != (host, port):
            raise ValueError(f"the session's relay forwards to {self._target[0]}:{self._target[1]} already, "
                             f"not to {host}:{port}")
        self._target = (host, port)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accepted, path=str(self.path))
        os.chmod(self.path, 0o666)  # the container's user may not be this one

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self.connections_total += 1
        try:
            if self._target is None:
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self._target)
            except OSError:
                return
            await splice(reader, writer, up_reader, up_writer)
        finally:
            writer.close()
            self._connections.discard(task)

    async def close(self) -> None:
        """Stop accepting, end every open connection, remove the socket. Safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        open_connections = list(self._connections)
        for task in open_connections:
            task.cancel()
        await asyncio.gather(*open_connections, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
