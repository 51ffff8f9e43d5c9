"""rollwire's background services (deploy/services.py): whose pid a pid file may be taken to be."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.services import ServiceProcess

_SLEEP = "import time; time.sleep(60)"


@contextmanager
def _running(*argv: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose command line holds ``argv`` (after ``-c``, so it runs nothing of rollwire), in a
    session of its own as the services are; killed on the way out if still running."""
    process = subprocess.Popen([sys.executable, "-c", _SLEEP, *argv], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and b"deploy.cli" not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
            time.sleep(0.02)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _proxy(home: Path, *args: str) -> ServiceProcess:
    service = ServiceProcess("proxy", args, None, home=home)
    service.pid_file.parent.mkdir(parents=True, exist_ok=True)
    return service


def test_a_pid_file_naming_another_rollwire_command_is_stale(tmp_path: Path) -> None:
    """A proxy's pid file left behind by a killed proxy (written before commands were recorded: the pid
    alone) names a pid that another rollwire command (here: one with the processors' arguments) has by
    now: it is not the proxy, and stopping the proxy leaves it alone."""
    proxy = _proxy(tmp_path, "proxy", "--port", "18080")
    with _running("deploy.cli", "processors", "--port", "18081") as other:
        proxy.pid_file.write_text(str(other.pid))
        assert proxy.pid() is None
        assert proxy.status()["running"] is False
        proxy.stop()
        assert other.poll() is None  # still running
        assert not proxy.pid_file.exists()


def test_down_knows_a_service_by_the_command_its_pid_file_recorded(tmp_path: Path) -> None:
    """`rollwire down` and `status` hold a handle without the service's arguments: the pid file's recorded
    command line is what tells the service from another rollwire command with the same pid."""
    started = _proxy(tmp_path, "proxy", "--port", "18080")
    stopper = _proxy(tmp_path)
    with _running("deploy.cli", "processors", "--port", "18081") as other:
        started.record(other.pid)  # the proxy's pid, now another command's
        assert stopper.pid() is None
        stopper.stop()
        assert other.poll() is None
    with _running("deploy.cli", "proxy", "--port", "18080") as proxy:
        started.record(proxy.pid)
        assert stopper.pid() == proxy.pid
        stopper.stop(timeout_s=5)
        assert proxy.wait(5) is not None


def test_a_pid_file_naming_the_service_itself_is_its_pid(tmp_path: Path) -> None:
    proxy = _proxy(tmp_path, "proxy", "--port", "18080")
    longer = _proxy(tmp_path / "b", "proxy", "--port", "1808")
    with _running("deploy.cli", "proxy", "--port", "18080") as running:
        proxy.pid_file.write_text(str(running.pid))
        longer.pid_file.write_text(str(running.pid))
        assert proxy.pid() == running.pid
        assert longer.pid() is None  # "1808" is not "18080": arguments are compared whole
        proxy.stop(timeout_s=5)
        assert running.wait(5) is not None
