"""The docker runtime on a real Docker engine: commands run in a container with the spec's limits (visible
in ``docker inspect`` and effective: a fork bomb hits the pids limit, memory past the limit is killed);
the workspace is the image's own repository at the base commit and the patch (new, modified and deleted
files, ignored ones left out) applies in a fresh container; a timed-out or cancelled run leaves no
process and teardown leaves no container (nor does a failed or cancelled init); a container with no
network reaches an HTTP server on the host's 127.0.0.1 through the relay (an SSE stream chunk by chunk,
concurrent requests, uploads, a half-closed request), ``host`` mode reaches it directly; the reaper
removes a container whose creator was SIGKILLed and keeps one whose creator lives.

The image is ``rollwire/base:bookworm`` when it exists, else ``rollwire/test-runtime:latest`` imported
from the debootstrap root at ``/tmp/rootfs-probe`` (``ROLLWIRE_TEST_ROOTFS``); a small image derived from
it holds the task repository at ``/testbed``, owned by another user (git's "dubious ownership").
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from producers.harness_install import harness_cache
from producers.runtimes.base import RuntimeInitError
from producers.runtimes.docker import (
    CONTAINER_RELAY_SCRIPT,
    CONTAINER_RUN,
    HARNESS_CACHE_LABEL,
    RELAY_PORT,
    DockerHandle,
    DockerRuntime,
    docker_client,
)
from producers.runtimes.reaper import (
    HOST_LABEL,
    PID_LABEL,
    PID_START_LABEL,
    SESSION_LABEL,
    creator_labels,
    reap_if_docker,
    reap_orphans,
)
from schemas.tasks import RuntimeSpec

BASE_IMAGE = "rollwire/base:bookworm"
FALLBACK_IMAGE = "rollwire/test-runtime:latest"
TESTBED_IMAGE = "rollwire/test-runtime-testbed:latest"
ROOTFS = Path(os.environ.get("ROLLWIRE_TEST_ROOTFS", "/tmp/rootfs-probe"))
REPO = Path(__file__).resolve().parents[2]

# The task repository baked into the test image: two commits, a .gitignore, owned by uid 1234.
TESTBED_DOCKERFILE = """\
FROM {base}
RUN mkdir /testbed && cd /testbed \\
 && printf 'def add(a, b):\\n    return a - b\\n' > calc.py && printf 'notes\\n' > README.md \\
 && printf '*.log\\n' > .gitignore \\
 && git init -q && git add -A \\
 && git -c user.name=t -c user.email=t@t commit -qm one \\
 && printf 'later\\n' > later.txt && git add -A && git -c user.name=t -c user.email=t@t commit -qm two \\
 && chown -R 1234:1234 /testbed
WORKDIR /testbed
LABEL rollwire.test=testbed
"""


def _has_image(client: Any, name: str) -> bool:
    try:
        client.images.get(name)
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def client() -> Any:
    return docker_client()


@pytest.fixture(scope="session")
def base_image(client: Any) -> str:
    """An image with sh, git, python3 and procps: the project's base image, or one imported here."""
    if _has_image(client, BASE_IMAGE):
        return BASE_IMAGE
    if not _has_image(client, FALLBACK_IMAGE):
        assert (ROOTFS / "usr" / "bin" / "git").exists(), (
            f"neither {BASE_IMAGE} nor a debootstrap root with git at {ROOTFS} (ROLLWIRE_TEST_ROOTFS) is here")
        tar = subprocess.Popen(["tar", "-C", str(ROOTFS), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-c", 'CMD ["/bin/bash"]', "-", FALLBACK_IMAGE], stdin=tar.stdout,
                       check=True, capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "0"})
        assert tar.wait() == 0
    return FALLBACK_IMAGE


@pytest.fixture(scope="session")
def testbed_image(client: Any, base_image: str) -> str:
    dockerfile = TESTBED_DOCKERFILE.format(base=base_image).encode()
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
    archive.seek(0)
    client.images.build(fileobj=archive, custom_context=True, tag=TESTBED_IMAGE, rm=True, forcerm=True)
    return TESTBED_IMAGE


@pytest.fixture
async def runtime(tmp_path: Path, client: Any) -> AsyncIterator[DockerRuntime]:
    runtime = DockerRuntime(tmp_path / "sessions", kill_grace_s=0.5, mount_harness_cache=False, node="node-t")
    yield runtime
    leftover = [c.name for c in client.containers.list(all=True, ignore_removed=True,
                                                       filters={"label": "rollwire.node=node-t"})]
    for name in leftover:
        client.containers.get(name).remove(force=True)
    assert leftover == [], "a test left containers behind"


def session_containers(client: Any, session_id: str) -> list[Any]:
    return client.containers.list(all=True, ignore_removed=True, filters={"label": f"{SESSION_LABEL}={session_id}"})


FORKS = """
import os, time
n = 0
try:
    for _ in range(80):
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError as exc:
    print("fork failed:", exc.strerror)
print("forked", n, flush=True)
"""


def processes(handle: DockerHandle) -> list[str]:
    """The container's processes but its init, as ``pid comm`` (read from the engine, not by an exec)."""
    container = docker_client().containers.get(handle.container_id)
    init = str(container.attrs["State"]["Pid"])
    top = container.top(ps_args="-o pid,comm")
    return [" ".join(row) for row in top["Processes"] if row[0] != init]


async def test_a_command_runs_in_a_container_with_the_spec_limits(runtime: DockerRuntime, client: Any,
                                                                  base_image: str, tmp_path: Path) -> None:
    repo = tmp_path / "task"
    repo.mkdir()
    (repo / "calc.py").write_text("VALUE = 1\n")
    spec = RuntimeSpec(kind="docker", image=base_image, repo=str(repo), network="none", cpus=0.5, memory="64m",
                       pids_limit=40, env={"GREETING": "hi"}, setup=["echo \"$GREETING\" > /tmp/from-setup"])
    # Not a repository: with runtime.repo unset the workspace must be the image's repository.
    with pytest.raises(RuntimeInitError, match="not a git repository"):
        await runtime.init("s-limits", spec.model_copy(update={"repo": None, "workdir": "/"}), timeout_s=120)
    assert session_containers(client, "s-limits") == [], "a failed init leaves no container"
    handle = await runtime.init("s-limits", spec, timeout_s=120)
    try:
        assert handle.start_s is not None and 0 < handle.start_s < 30
        assert handle.proxy_url_for("http://127.0.0.1:9/x") == "http://127.0.0.1:9/x"
        result = await handle.run(["sh", "-c", "cat /tmp/from-setup; pwd; echo $HOME; echo $X; cat"],
                                  env={"X": "1"}, timeout_s=60, stdin="in\n")
        assert result.exit_code == 0 and result.stdout.split() == ["hi", "/workspace", "/rollwire/home", "1", "in"]

        attrs = client.containers.get(handle.container_id).attrs
        host_config, labels = attrs["HostConfig"], attrs["Config"]["Labels"]
        assert (host_config["NanoCpus"], host_config["Memory"], host_config["MemorySwap"],
                host_config["PidsLimit"], host_config["NetworkMode"]) == (500_000_000, 64 << 20, 64 << 20, 40, "none")
        assert labels[SESSION_LABEL] == "s-limits" and labels["rollwire.node"] == "node-t"
        assert {k: labels[k] for k in (HOST_LABEL, PID_LABEL, PID_START_LABEL)} == creator_labels()

        no_net = await handle.run(["sh", "-c", "ls /sys/class/net"], env={}, timeout_s=30)
        assert no_net.stdout.split() == ["lo"]
        # A fork bomb of sorts: forks fail at the limit.
        bomb = await handle.run(["python3", "-c", FORKS], env={}, timeout_s=60)
        assert "fork failed" in bomb.stdout and int(bomb.stdout.split("forked ")[1]) < 40, bomb
        await handle.kill_all(grace_s=0)
        assert handle.host_workspace is not None
        (handle.host_workspace / "calc.py").write_text("VALUE = 2\n")
        assert "+VALUE = 2" in await handle.patch()
        hog = await handle.run(["python3", "-c", "x = bytearray(200 << 20); x[::4096] = b'1' * len(x[::4096])"],
                               env={}, timeout_s=60)
        assert hog.exit_code == 137, f"200 MiB in a 64 MiB container was not killed: {hog}"
        assert hog.oom_killed is True, f"the engine's oom event was not read: {hog}"
    finally:
        await handle.teardown()
    assert session_containers(client, "s-limits") == [] and not handle.host_root.exists()


async def test_workspace_is_the_images_repository_at_the_base_commit(runtime: DockerRuntime, client: Any,
                                                                     testbed_image: str) -> None:
    first = (await _image_commits(client, testbed_image))[-1]
    spec = RuntimeSpec(kind="docker", image=testbed_image, base_commit=first, network="none")
    handle = await runtime.init("s-image-ws", spec, timeout_s=120)
    try:
        assert handle.workspace == "/testbed" and handle.base_commit == first and handle.host_workspace is None
        state = await handle.run(["sh", "-c", "ls -A; git rev-parse HEAD; git status --porcelain"], env={},
                                 timeout_s=60)
        assert state.exit_code == 0, state.stderr  # git works for the harness too, despite the owner
        assert state.stdout.split() == [".git", ".gitignore", "README.md", "calc.py", first]
        assert await handle.patch() == ""
        edit = ("printf 'def add(a, b):\\n    return a + b\\n' > calc.py && rm README.md && mkdir -p pkg "
                "&& printf 'VALUE = 1\\n' > pkg/new.py && printf 'bin\\000ary' > data.bin && echo x > run.log")
        assert (await handle.run(["sh", "-c", edit], env={}, timeout_s=60)).exit_code == 0
        patch = await handle.patch()
    finally:
        await handle.teardown()
    files = {line.split(" b/")[-1] for line in patch.splitlines() if line.startswith("diff --git")}
    assert files == {"calc.py", "README.md", "pkg/new.py", "data.bin"}
    assert "GIT binary patch" in patch

    review = await runtime.init("s-image-review", spec, timeout_s=120)
    try:
        applied = await review.run(["sh", "-c", "git apply --index - && cat calc.py pkg/new.py && ls"], env={},
                                   timeout_s=60, stdin=patch)
        assert applied.exit_code == 0, applied.stderr
        assert applied.stdout.split() == ["def", "add(a,", "b):", "return", "a", "+", "b", "VALUE", "=", "1",
                                          "calc.py", "data.bin", "pkg"]
    finally:
        await review.teardown()

    with pytest.raises(RuntimeInitError, match="0123456789abcdef"):
        await runtime.init("s-bad-base", spec.model_copy(update={"base_commit": "0123456789abcdef"}), timeout_s=120)
    with pytest.raises(RuntimeInitError, match="not on this Docker engine"):
        await runtime.init("s-no-image", spec.model_copy(update={"image": "rollwire/absent:none"}), timeout_s=60)


async def _image_commits(client: Any, image: str) -> list[str]:
    """The commits of the image's /testbed, newest first."""
    out = client.containers.run(image, ["git", "-c", "safe.directory=*", "log", "--format=%H"], remove=True,
                                network_mode="none")
    return out.decode().split()


SLEEPER = "sh -c 'trap \"\" TERM; sleep 300' & echo $! > $HOME/child.pid; wait"


async def test_timeout_and_cancel_leave_no_process_and_teardown_no_container(runtime: DockerRuntime, client: Any,
                                                                            testbed_image: str) -> None:
    spec = RuntimeSpec(kind="docker", image=testbed_image)
    handle = await runtime.init("s-timeout", spec, timeout_s=120)
    try:
        result = await handle.run(["sh", "-c", f"echo started; {SLEEPER}"], env={}, timeout_s=1.5)
        assert result.timed_out and result.exit_code is None and "started" in result.stdout
        assert processes(handle) == [], "processes outlived the timed-out run"
        again = await handle.run(["echo", "still usable"], env={}, timeout_s=30)
        assert again.stdout.strip() == "still usable"
    finally:
        await handle.teardown()
    assert session_containers(client, "s-timeout") == []

    handle = await runtime.init("s-cancel", spec, timeout_s=120)
    try:
        run = asyncio.ensure_future(handle.run(["sh", "-c", SLEEPER], env={}, timeout_s=300))
        deadline = time.monotonic() + 30
        while not (handle.host_home / "child.pid").exists():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert any("sleep" in row for row in processes(handle))
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert processes(handle) == [], "processes outlived the cancelled run"
    finally:
        await handle.teardown()
        await handle.teardown()
    assert session_containers(client, "s-cancel") == [] and not handle.host_root.exists()

    # Cancelled while the engine is still creating the container: nothing is left either.
    slow = spec.model_copy(update={"setup": ["sleep 60"]})
    for delay in (0.02, 0.2, 1.5):  # creating the container, waiting for the relay, running set-up
        init = asyncio.ensure_future(runtime.init(f"s-cancel-init-{delay}", slow, timeout_s=120))
        await asyncio.sleep(delay)
        init.cancel()
        with pytest.raises(asyncio.CancelledError):
            await init
        assert session_containers(client, f"s-cancel-init-{delay}") == []
    assert list(runtime.root.iterdir()) == []


# -- the relay ---------------------------------------------------------------------------------------

SSE_EVENTS = 4
SSE_GAP_S = 0.4


async def _http_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A tiny HTTP/1.1 server: /sse streams events apart in time, /slow answers after 1 s, /echo returns
    the body (read to EOF when the request has no length: a half-closed upload)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode().split("\r\n")
        method, path, _ = request_line.split(" ")
        headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
        if path.startswith("/sse"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            for i in range(SSE_EVENTS):
                writer.write(f"data: {i}\n\n".encode())
                await writer.drain()
                await asyncio.sleep(SSE_GAP_S)
        elif path.startswith("/slow"):
            await asyncio.sleep(1.0)
            body = path.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        else:
            length = headers.get("Content-Length")
            body = await (reader.readexactly(int(length)) if length is not None else reader.read())
            reply = json.dumps({"method": method, "bytes": len(body), "sum": sum(body)}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(reply), reply))
        await writer.drain()
    finally:
        writer.close()


@pytest.fixture
async def host_server() -> AsyncIterator[int]:
    server = await asyncio.start_server(_http_server, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


# Run inside the container: the three checks, reported as one JSON line.
CLIENT = r"""
import http.client, json, socket, sys, threading, time
base, port = sys.argv[1], int(sys.argv[2])
host, _, bport = base.split("//")[1].split("/")[0].partition(":")
out = {}
start = time.monotonic()
c = http.client.HTTPConnection(host, int(bport), timeout=30)
c.request("GET", "/sse")
r = c.getresponse()
out["sse_type"] = r.getheader("Content-Type")
arrivals = []
while True:
    line = r.fp.readline()
    if not line:
        break
    if line.startswith(b"data:"):
        arrivals.append(round(time.monotonic() - start, 3))
out["sse"] = arrivals
results = {}
def slow(i):
    k = http.client.HTTPConnection(host, int(bport), timeout=30)
    k.request("GET", "/slow/%d" % i)
    results[i] = k.getresponse().read().decode()
started = time.monotonic()
threads = [threading.Thread(target=slow, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
out["concurrent_s"] = round(time.monotonic() - started, 3)
out["concurrent"] = [results[i] for i in range(8)]
s = socket.create_connection((host, int(bport)), timeout=30)
payload = bytes(range(256)) * 4096
s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n\r\n" + payload)
s.shutdown(socket.SHUT_WR)
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
out["echo"] = json.loads(data.split(b"\r\n\r\n", 1)[1])
out["expected_sum"] = sum(payload)
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    out["direct"] = "reached"
except OSError as exc:
    out["direct"] = type(exc).__name__
print(json.dumps(out))
"""


def _check_client_report(report: dict[str, Any]) -> None:
    assert report["sse_type"] == "text/event-stream"
    arrivals = report["sse"]
    assert len(arrivals) == SSE_EVENTS
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert all(gap > SSE_GAP_S * 0.6 for gap in gaps), f"the stream was buffered: arrivals {arrivals}"
    assert report["concurrent"] == [f"/slow/{i}" for i in range(8)]
    assert report["concurrent_s"] < 4, "the 8 requests did not run concurrently"
    assert report["echo"] == {"method": "POST", "bytes": 256 * 4096, "sum": report["expected_sum"]}


async def test_relay_brings_a_container_without_network_to_the_hosts_loopback(
        runtime: DockerRuntime, client: Any, testbed_image: str, host_server: int) -> None:
    handle = await runtime.init("s-relay", RuntimeSpec(kind="docker", image=testbed_image), timeout_s=120)
    try:
        attrs = client.containers.get(handle.container_id).attrs
        assert attrs["HostConfig"]["NetworkMode"] == "none"
        assert {m["Destination"]: m["RW"] for m in attrs["Mounts"]}[CONTAINER_RELAY_SCRIPT] is False
        assert CONTAINER_RUN in {m["Destination"] for m in attrs["Mounts"]}
        url = handle.proxy_url_for(f"http://127.0.0.1:{host_server}/prefix")
        assert url == f"http://127.0.0.1:{RELAY_PORT}/prefix"
        with pytest.raises(ValueError, match="forwards to"):
            handle.proxy_url_for("http://127.0.0.1:1/other")
        result = await handle.run(["python3", "-c", CLIENT, url, str(host_server)], env={}, timeout_s=120)
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout)
        _check_client_report(report)
        assert report["direct"] == "ConnectionRefusedError", "the container reached the host without the relay"
        assert handle.relay is not None and handle.relay.connections_total >= 10
        # The relay (the container's PID 1) survives the kill of a timed-out run.
        await handle.run(["sleep", "60"], env={}, timeout_s=0.5)
        again = await handle.run(["python3", "-c", CLIENT, url, str(host_server)], env={}, timeout_s=120)
        assert again.exit_code == 0, again.stderr
    finally:
        await handle.teardown()
    assert not (handle.run_dir / "proxy.sock").exists()


async def test_host_network_reaches_the_hosts_loopback_directly(runtime: DockerRuntime, client: Any,
                                                               testbed_image: str, host_server: int) -> None:
    spec = RuntimeSpec(kind="docker", image=testbed_image, network="host")
    handle = await runtime.init("s-host-net", spec, timeout_s=120)
    try:
        assert client.containers.get(handle.container_id).attrs["HostConfig"]["NetworkMode"] == "host"
        url = handle.proxy_url_for(f"http://127.0.0.1:{host_server}")
        assert url == f"http://127.0.0.1:{host_server}" and handle.relay is None
        result = await handle.run(["python3", "-c", CLIENT, url, str(host_server)], env={}, timeout_s=120)
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout)
        _check_client_report(report)
        assert report["direct"] == "reached"
    finally:
        await handle.teardown()


def test_harness_cache_is_mounted_unless_the_image_carries_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_CACHE_DIR", str(tmp_path / "cache"))
    cache = harness_cache()
    cache.mkdir(parents=True)
    runtime = DockerRuntime(tmp_path)
    spec = RuntimeSpec(kind="docker", image="x", network="none")
    assert runtime.volumes(spec, tmp_path / "s", "/testbed", image_labels={})[str(cache)] == \
        {"bind": str(cache), "mode": "ro"}
    carried = runtime.volumes(spec, tmp_path / "s", "/testbed", image_labels={HARNESS_CACHE_LABEL: str(cache)})
    assert str(cache) not in carried
    other = runtime.volumes(spec, tmp_path / "s", "/testbed", image_labels={HARNESS_CACHE_LABEL: "/elsewhere"})
    assert str(cache) in other


# -- the reaper --------------------------------------------------------------------------------------

CREATOR = """
import json, sys
import docker
from producers.runtimes.reaper import creator_labels
client = docker.from_env()
c = client.containers.run(sys.argv[1], ["sleep", "infinity"], detach=True, network_mode="none",
                          labels={"rollwire.session": "s-orphan", **creator_labels()})
print(c.id, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def orphan_maker(base_image: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, "-c", CREATOR, base_image], cwd=REPO, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    yield process
    process.kill()
    process.wait()


def test_reaper_removes_containers_of_a_dead_creator_only(client: Any, base_image: str,
                                                          orphan_maker: subprocess.Popen[str]) -> None:
    assert orphan_maker.stdout is not None
    orphan = orphan_maker.stdout.readline().strip()
    live = client.containers.run(base_image, ["sleep", "infinity"], detach=True, network_mode="none",
                                 labels={SESSION_LABEL: "s-live", **creator_labels()})
    reused = client.containers.run(base_image, ["sleep", "infinity"], detach=True, network_mode="none",
                                   labels={SESSION_LABEL: "s-reused", **creator_labels(), PID_START_LABEL: "1"})
    orphan_name = client.containers.get(orphan).name
    try:
        first = reap_orphans(client)
        assert orphan_name not in first, "the creator still lives"
        assert reused.name in first, "a pid whose start time differs is not the creator"
        os.kill(orphan_maker.pid, signal.SIGKILL)
        orphan_maker.wait()
        assert orphan_name in reap_if_docker()  # the gateway node's pass
        assert client.containers.get(live.id).status == "running"
        assert _gone(client, orphan) and _gone(client, reused.id)
    finally:
        for container in (live, reused):
            if not _gone(client, container.id):
                container.remove(force=True)
        if not _gone(client, orphan):
            client.containers.get(orphan).remove(force=True)


def test_reaper_module_runs_one_pass(client: Any, base_image: str) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid = dead.stdout.strip()
    container = client.containers.create(base_image, ["sleep", "infinity"], network_mode="none",
                                         labels={SESSION_LABEL: "s-module", **creator_labels(int(pid)),
                                                 PID_LABEL: pid, PID_START_LABEL: "12345"})
    try:
        result = subprocess.run([sys.executable, "-m", "producers.runtimes.reaper"], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert container.name in result.stdout.split() and _gone(client, container.id)
    finally:
        if not _gone(client, container.id):
            container.remove(force=True)


def _gone(client: Any, container_id: str) -> bool:
    try:
        client.containers.get(container_id)
    except Exception as exc:
        return type(exc).__name__ == "NotFound"
    return False


async def test_a_long_session_root_still_gets_a_relay(client: Any, testbed_image: str, host_server: int,
                                                      tmp_path: Path) -> None:
    root = tmp_path / ("deep" * 20) / "sessions"
    runtime = DockerRuntime(root, kill_grace_s=0.5, node="node-t")
    handle = await runtime.init("s-long-root", RuntimeSpec(kind="docker", image=testbed_image), timeout_s=120)
    try:
        assert not handle.run_dir.is_relative_to(handle.host_root), "the socket path would be too long"
        url = handle.proxy_url_for(f"http://127.0.0.1:{host_server}")
        fetch = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1] + '/slow/7').read().decode())"
        result = await handle.run(["python3", "-c", fetch, url], env={}, timeout_s=60)
        assert result.stdout.strip() == "/slow/7", result.stderr
    finally:
        await handle.teardown()
    assert not handle.run_dir.exists() and session_containers(client, "s-long-root") == []


async def test_the_gateway_node_reaps_at_start(client: Any, base_image: str) -> None:
    from producers.gateway.node import GatewayNode
    from producers.gateway.settings import GatewaySettings
    from schemas.transport import KafkaSettings

    orphan = client.containers.create(base_image, ["sleep", "infinity"], network_mode="none",
                                      labels={SESSION_LABEL: "s-node-orphan", **creator_labels(),
                                              PID_START_LABEL: "not-this-process"})
    node = GatewayNode(GatewaySettings(port=0), KafkaSettings())
    reaping = asyncio.ensure_future(node._reap_forever())
    try:
        deadline = time.monotonic() + 60
        while not _gone(client, orphan.id):
            assert time.monotonic() < deadline, "the node's reaper pass did not remove the orphan"
            await asyncio.sleep(0.2)
        assert not reaping.done()
    finally:
        reaping.cancel()
        if not _gone(client, orphan.id):
            orphan.remove(force=True)


BOMB = """
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(300)
            os._exit(0)
    except OSError:
        time.sleep(300)
"""


async def test_a_run_at_the_pids_limit_is_still_killed_at_its_timeout(runtime: DockerRuntime, client: Any,
                                                                      testbed_image: str) -> None:
    spec = RuntimeSpec(kind="docker", image=testbed_image, network="none", pids_limit=16)
    handle = await runtime.init("s-bomb", spec, timeout_s=120)
    try:
        started = time.monotonic()
        result = await handle.run(["python3", "-c", BOMB], env={}, timeout_s=2)
        assert result.timed_out and time.monotonic() - started < 20
        assert processes(handle) == [], "the fork bomb outlived its timeout"
        assert (await handle.run(["echo", "usable"], env={}, timeout_s=30)).stdout.strip() == "usable"
        # The fallback when no exec can start: the processes are killed by their host pids. (This second
        # bomb forks again only if the container's init reaped the first one's killed orphans: zombies
        # keep counting against the pids limit.)
        run = asyncio.ensure_future(handle.run(["python3", "-c", BOMB], env={}, timeout_s=300))
        deadline = time.monotonic() + 30
        while len(processes(handle)) < 10:
            assert time.monotonic() < deadline, (processes(handle), run.done() and run.result())
            await asyncio.sleep(0.1)
        await asyncio.to_thread(handle._kill_from_host)
        result = await asyncio.wait_for(run, 30)
        assert result.exit_code == 137 and processes(handle) == []
    finally:
        await handle.teardown()
