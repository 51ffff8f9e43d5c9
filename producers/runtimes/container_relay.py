"""The container side of the proxy relay: TCP on 127.0.0.1:<port> inside a container → a Unix socket.

A container started with no network (``RuntimeSpec.network == "relay"``) still reaches the proxy: the
docker runtime bind-mounts a directory holding a Unix socket that the host side
(:mod:`producers.runtimes.relay`) forwards to the proxy's TCP address, and runs this script, read-only
mounted, as the container's main process (``python3 container_relay.py --listen 127.0.0.1:PORT --socket
PATH --ready FILE``). Each TCP connection accepted here is forwarded to a new connection on the socket,
bytes as they come in both directions (SSE streams are never buffered), a half-close passed on as one.

Being the container's PID 1 has two uses: ``kill -1`` (how the runtime ends a timed-out harness) spares
it, and it reaps orphaned processes (SIGCHLD ignored), as an init must: killed processes must not stay
zombies holding the container's pids limit. Without ``--listen`` it is only that init (containers with
``host`` or no network). Readiness: once listening, it writes its pid to the ``--ready`` file.

Standard library only, and importable on the host too (``pump`` is shared with the host side).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

CHUNK = 65536


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` chunk by chunk as bytes arrive; at EOF half-close ``writer``."""
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def splice(a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter,
                 b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter) -> None:
    """Forward both ways until both directions ended, then close both ends."""
    try:
        await asyncio.gather(pump(a_reader, b_writer), pump(b_reader, a_writer))
    finally:
        for writer in (a_writer, b_writer):
            writer.close()
        for writer in (a_writer, b_writer):
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _serve(host: str, port: int, socket_path: str, ready: str | None) -> None:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
        except OSError as exc:
            print(f"rollwire relay: {socket_path}: {exc}", file=sys.stderr, flush=True)
            writer.close()
            return
        await splice(reader, writer, up_reader, up_writer)

    server = await asyncio.start_server(connection, host, port, reuse_address=True)
    if ready:
        with open(ready + ".tmp", "w") as out:
            out.write(f"{os.getpid()}\n")
        os.replace(ready + ".tmp", ready)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--listen", help="HOST:PORT to accept TCP connections on (none: only be the init)")
    parser.add_argument("--socket", help="the Unix socket to forward them to")
    parser.add_argument("--ready", help="a file to write this process's pid to once listening")
    args = parser.parse_args(argv)
    if os.getpid() == 1:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # as init: orphans are reaped by the kernel
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: sys.exit(0))
    if args.listen is None:
        while True:
            signal.pause()
    if args.socket is None:
        parser.error("--listen needs --socket")
    host, _, port = args.listen.rpartition(":")
    asyncio.run(_serve(host or "127.0.0.1", int(port), args.socket, args.ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
