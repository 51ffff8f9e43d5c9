"""The Docker engine bring-up (deploy/docker_engine.py) on the real dockerd of this machine.

One engine is adopted (the one already running, or rollwire's own started once), never a second one for
the same socket; a second daemon on its own data root, socket and exec root under tmp starts (once, even
when two callers race), answers and stops cleanly, leaving no mount behind.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest

from deploy import docker_engine
from deploy.docker_engine import (EngineConfig, client_for, daemon_pid, engine_answers, ensure_engine, reap_containers,
                                  start_engine, stop_engine)
from deploy.errors import MissingToolError


def _dockerd_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if os.path.basename(argv0) == b"dockerd":
                pids.add(int(entry.name))
    return pids


def test_an_engine_that_answers_is_adopted_not_started_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    first = ensure_engine()  # adopts the running engine (or, on a bare machine, starts rollwire's own once)
    assert engine_answers(first)
    before = _dockerd_pids()

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    assert ensure_engine() == first
    assert os.environ["DOCKER_HOST"] == first  # exported for the SDK and the docker CLI

    # A DOCKER_HOST that does not answer is passed over for the next engine that does.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    assert ensure_engine() == first
    assert _dockerd_pids() == before
    own = EngineConfig()
    if first == own.url:
        assert daemon_pid(own) in before


def test_a_second_daemon_starts_once_and_stops_cleanly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    config = EngineConfig(root=tmp_path / "docker", exec_root=Path(f"/tmp/rw-t{uuid.uuid4().hex[:6]}"))
    others = _dockerd_pids()
    urls: list[str] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            urls.append(ensure_engine(config, adopt_others=False))
        except BaseException as exc:
            errors.append(exc)

    try:
        racers = [threading.Thread(target=start) for _ in range(2)]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(60)
        assert not errors, errors
        assert urls == [config.url, config.url]
        started = _dockerd_pids() - others
        pid = daemon_pid(config)
        assert pid is not None and started == {pid}  # two callers, one daemon
        client = client_for(config.url)
        try:
            assert client.info()["DockerRootDir"] == str(config.data_root)
        finally:
            client.close()
        assert "--bridge=none" in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")

        assert stop_engine(config) is True
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        assert not engine_answers(config.url)
        assert docker_engine._mounts_under(config.exec_dir) == []
        assert stop_engine(config) is False  # nothing left to stop
        assert others <= _dockerd_pids()  # the other engines were left alone
    finally:
        stop_engine(config)
        shutil.rmtree(config.exec_dir, ignore_errors=True)


def test_a_stale_pid_file_naming_another_live_process_does_not_stop_the_start(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A daemon that died (killed, the machine restarted) leaves its pid file; once its pid belongs to
    another process, dockerd itself refuses to start over it ("pid file found")."""
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    config = EngineConfig(root=tmp_path / "docker", exec_root=Path(f"/tmp/rw-t{uuid.uuid4().hex[:6]}"))
    config.root.mkdir(parents=True)
    config.pid_file.write_text(f"{os.getpid()}\n")  # alive, and not a dockerd
    assert daemon_pid(config) is None
    try:
        assert ensure_engine(config, adopt_others=False) == config.url
        pid = daemon_pid(config)
        assert pid is not None and pid != os.getpid()
        assert engine_answers(config.url)
        assert stop_engine(config) is True
    finally:
        stop_engine(config)
        shutil.rmtree(config.exec_dir, ignore_errors=True)
    assert Path(f"/proc/{os.getpid()}").exists()  # the process the stale file named was left alone


def test_missing_dockerd_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(docker_engine, "_DOCKERD_FALLBACKS", ())
    config = EngineConfig(root=tmp_path / "docker", exec_root=tmp_path / "exec")
    with pytest.raises(MissingToolError, match=r"apt-get install -y docker\.io"):
        start_engine(config)


def test_reap_removes_labelled_containers_by_age(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    url = ensure_engine()
    client = client_for(url)
    marker = f"rollwire.test={uuid.uuid4().hex}"
    # An image with nothing in it is enough for a container that is only created, never started.
    (tmp_path / "empty").mkdir()
    empty = f"rollwire/test-empty:{uuid.uuid4().hex[:8]}"
    client.images.build(path=str(tmp_path / "empty"), fileobj=None, tag=empty, rm=True,
                        dockerfile=_write(tmp_path / "empty" / "Dockerfile", "FROM scratch\nLABEL x=y\n"))
    try:
        container = client.containers.create(empty, command=["nothing"], labels={
            "rollwire.session": "s-reap", marker.split("=")[0]: marker.split("=")[1]})
        labels = ("rollwire.session", marker)
        assert reap_containers(url, older_than_s=3600, labels=labels) == []
        removed = reap_containers(url, labels=labels)
        assert [(r.name, r.session_id) for r in removed] == [(container.name, "s-reap")]
        assert client.containers.list(all=True, ignore_removed=True, filters={"label": marker}) == []
    finally:
        for leftover in client.containers.list(all=True, ignore_removed=True, filters={"label": marker}):
            leftover.remove(force=True)
        client.images.remove(empty, force=True)
        client.close()


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)
