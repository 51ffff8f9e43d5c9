"""rollwire's background services (deploy/services.py): whose pid a pid file may be taken to be."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from deploy.services import ServiceProcess

_SLEEP = "import time; time.sleep(60)"


def _spawn(*argv: str) -> subprocess.Popen[bytes]:
    """A process whose command line holds ``argv`` (after ``-c``, so it runs nothing of rollwire), in a
    session of its own as the services are."""
    process = subprocess.Popen([sys.executable, "-c", _SLEEP, *argv], start_new_session=True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and b"deploy.cli" not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
        time.sleep(0.02)
    return process


def test_a_pid_file_naming_another_rollwire_command_is_stale(tmp_path: Path) -> None:
    """A proxy's pid file left behind by a killed proxy (written before commands were recorded: the pid
    alone) names a pid that another rollwire command (here: one with the processors' arguments) has by
    now: it is not the proxy, and stopping the proxy leaves it alone."""
    proxy = ServiceProcess("proxy", ("proxy", "--port", "18080"), None, home=tmp_path)
    other = _spawn("deploy.cli", "processors", "--port", "18081")
    try:
        proxy.pid_file.parent.mkdir(parents=True)
        proxy.pid_file.write_text(str(other.pid))
        assert proxy.pid() is None
        assert proxy.status()["running"] is False
        proxy.stop()
        assert other.poll() is None  # still running
        assert not proxy.pid_file.exists()
    finally:
        other.kill()
        other.wait()


def test_down_knows_a_service_by_the_command_its_pid_file_recorded(tmp_path: Path) -> None:
    """`rollwire down` and `status` hold a handle without the service's arguments: the pid file's recorded
    command line is what tells the service from another rollwire command with the same pid."""
    started = ServiceProcess("proxy", ("proxy", "--port", "18080"), None, home=tmp_path)
    stopper = ServiceProcess("proxy", (), None, home=tmp_path)
    started.pid_file.parent.mkdir(parents=True)
    other = _spawn("deploy.cli", "processors", "--port", "18081")
    try:
        started.record(other.pid)  # the proxy's pid, now another command's
        assert stopper.pid() is None
        stopper.stop()
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
    running = _spawn("deploy.cli", "proxy", "--port", "18080")
    try:
        started.record(running.pid)
        assert stopper.pid() == running.pid
        stopper.stop(timeout_s=5)
        assert running.wait(5) is not None
    finally:
        if running.poll() is None:
            running.kill()
            running.wait()


def test_a_pid_file_naming_the_service_itself_is_its_pid(tmp_path: Path) -> None:
    proxy = ServiceProcess("proxy", ("proxy", "--port", "18080"), None, home=tmp_path)
    running = _spawn("deploy.cli", "proxy", "--port", "18080")
    longer = ServiceProcess("proxy", ("proxy", "--port", "1808"), None, home=tmp_path / "b")
    try:
        proxy.pid_file.parent.mkdir(parents=True)
        proxy.pid_file.write_text(str(running.pid))
        assert proxy.pid() == running.pid
        longer.pid_file.parent.mkdir(parents=True)
        longer.pid_file.write_text(str(running.pid))
        assert longer.pid() is None  # "1808" is not "18080": arguments are compared whole
        proxy.stop(timeout_s=5)
        assert running.wait(5) is not None
    finally:
        if running.poll() is None:
            running.kill()
            running.wait()
