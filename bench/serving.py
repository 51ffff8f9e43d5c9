"""Serving ASGI apps on real loopback sockets (uvicorn in a thread), for benchmarks and tests: HTTP is real."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve(app: Any, port: int | None = None, timeout_s: float = 30,
          server: uvicorn.Server | None = None) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 until the block ends; yields its base URL. ``server`` runs it instead
    of a plain uvicorn server (its config's port is then the one served)."""
    if server is None:
        port = port or free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False, lifespan="on"))
    else:
        port = server.config.port
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"test server on port {port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
