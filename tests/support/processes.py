"""``rollwire`` commands as processes of their own, for tests that kill them: started in their own session
(a kill takes their children too), their output in a log, yielded once they answer, killed on the way out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from schemas.transport import KafkaSettings

ROOT = Path(__file__).resolve().parents[2]


def kafka_env(kafka: KafkaSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment) with the test's Kafka settings as ``ROLLWIRE_*`` (its topic
    prefix included), so that the process uses the test's topics."""
    env = dict(os.environ if base is None else base)
    for name, value in kafka.model_dump().items():
        if isinstance(value, (str, int, float, bool)):
            env[f"ROLLWIRE_{name.upper()}"] = str(value)
    return env


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def rollwire_process(argv: list[str], env: dict[str, str], log: Path, ready: Callable[[], bool],
                     timeout_s: float = 90) -> Iterator[subprocess.Popen[bytes]]:
    """``rollwire ARGV`` (this checkout's code), yielded once ``ready()``; its log's tail in the failure when
    it exits or is not ready within ``timeout_s``; SIGKILLed with its children on the way out if it still runs."""
    with log.open("ab") as out:
        process = subprocess.Popen([str(Path(sys.executable).parent / "rollwire"), *argv], cwd=ROOT, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert process.poll() is None, f"{argv} exited {process.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{argv} not ready in {timeout_s:g}s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
