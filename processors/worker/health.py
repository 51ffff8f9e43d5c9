"""The ``GET /health`` page of a Faust worker (the trajectory and groups workers), without aiohttp.

200 once the worker's tables are recovered and no rebalance is going on, else 503; the body is JSON with
``ok`` and the worker's counters. A bare asyncio server: Faust's own web server (aiohttp) is off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import faust
import orjson

from processors.worker.faust_worker import tables_recovered


async def serve_health(app: faust.App, host: str, port: int, counters: Callable[[], dict[str, Any]]) -> None:
    """Answer health requests on ``host:port`` until cancelled."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readline(), 5)
            ok = tables_recovered(app) and not app.rebalancing
            body = orjson.dumps({"ok": ok, **counters()})
            status = b"200 OK" if ok else b"503 Service Unavailable"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, host, port)
    async with server:
        await server.serve_forever()
