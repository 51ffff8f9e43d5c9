"""Running a harness CLI with only loopback: a network namespace whose one way out is the proxy.

The CLI runs under ``unshare --net`` (a fresh network namespace: loopback only, no route anywhere), so a
session that finishes proves that the harness needed nothing but the proxy (no telemetry, update check or
model-hub look-up blocked it). The proxy listens in the test's own namespace; the two meet through a
Unix socket, which is a file and so crosses namespaces:

    CLI -> 127.0.0.1:PORT (inside)  --relay-->  proxy.sock  --relay-->  127.0.0.1:PORT (the proxy, outside)

Both relays are this module run as a script. The port inside is the proxy's own, so the base URLs a
session hands out work unchanged. Where namespaces cannot be made (not root, no ``unshare``), the CLI runs
directly and the reason is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def namespace_unavailable() -> str | None:
    """Why a loopback-only network namespace cannot be made here, or None if it can."""
    if shutil.which("unshare") is None:
        return "unshare is not installed (util-linux)"
    probe = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up || true"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare --net failed: {probe.stderr.strip()[:200]}"
    return None


def run_harness(command: list[str], *, cwd: Path, env: dict[str, str], proxy_url: str,
                timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with only loopback, reaching just ``proxy_url``; output captured as text."""
    reason = namespace_unavailable()
    if reason is not None:
        print(f"running {Path(command[0]).name} without network isolation: {reason}", file=sys.stderr)
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    target = urlsplit(proxy_url)
    host, port = target.hostname or "127.0.0.1", target.port or 80
    with tempfile.TemporaryDirectory(prefix="rollwire-ns-") as scratch:
        socket_path = Path(scratch) / "proxy.sock"
        outer = subprocess.Popen([sys.executable, "-m", "tests.harnesses.isolation", "outer", str(socket_path),
                                  host, str(port)], cwd=_ROOT)
        try:
            deadline = time.monotonic() + 10
            while not socket_path.exists():
                if outer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the relay to the proxy did not start")
                time.sleep(0.02)
            inner = [sys.executable, "-m", "tests.harnesses.isolation", "inner", str(socket_path), str(port),
                     "--", *command]
            script = "ip link set lo up && exec \"$@\""
            return subprocess.run(["unshare", "--net", "sh", "-c", script, "sh", *inner], cwd=cwd,
                                  env={**env, "PYTHONPATH": str(_ROOT)}, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=timeout_s)
        finally:
            outer.terminate()
            outer.wait(timeout=10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


def _relay(connect):  # connect: () -> awaitable (reader, writer)
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await connect()
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
    return handle


async def _outer(socket_path: str, host: str, port: int) -> None:
    server = await asyncio.start_unix_server(_relay(lambda: asyncio.open_connection(host, port)), socket_path)
    async with server:
        await server.serve_forever()


async def _inner(socket_path: str, port: int, command: list[str]) -> int:
    server = await asyncio.start_server(_relay(lambda: asyncio.open_unix_connection(socket_path)),
                                        "127.0.0.1", port)
    async with server:
        process = await asyncio.create_subprocess_exec(*command, env={k: v for k, v in os.environ.items()
                                                                       if k != "PYTHONPATH"})
        return await process.wait()


def main(argv: list[str]) -> int:
    mode, socket_path, *rest = argv
    if mode == "outer":
        asyncio.run(_outer(socket_path, rest[0], int(rest[1])))
        return 0
    port, separator, *command = rest
    assert separator == "--", "usage: inner SOCKET PORT -- COMMAND..."
    return asyncio.run(_inner(socket_path, int(port), command))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
