"""Runtimes: the local runtime prepares real workspaces (a plain directory, a git repository at a base
commit), runs set-up commands and harness commands as process groups (timeouts and cancellation kill the
children too), and hands back a patch that applies to a fresh checkout of the base commit, without
harness config, caches or build output. The docker runtime's engine-free parts (mount parsing, the proxy
URL a relay container reaches, its bind mounts) are checked here; its container tests are in
test_docker_runtime.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from producers.runtimes import runtime_for
from producers.runtimes.base import RuntimeInitError
from producers.runtimes.docker import CONTAINER_RELAY_SCRIPT, RELAY_PORT, RELAY_SCRIPT, DockerRuntime, parse_mount, relay_url
from producers.runtimes.local import LocalHandle, LocalRuntime
from producers.runtimes.workspace import PATCH_EXCLUDES
from schemas.tasks import RuntimeSpec

BINARY = bytes(range(256)) * 4


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def runtime(tmp_path: Path) -> LocalRuntime:
    return LocalRuntime(tmp_path / "sessions", kill_grace_s=0.5)


@pytest.fixture
def plain_repo(tmp_path: Path) -> Path:
    """A task repository shipped as a plain directory (as examples/ does), inside some other git repo."""
    outer = tmp_path / "project"
    repo = outer / "examples" / "task"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "README.md").write_text("a task\n")
    (repo / "logo.bin").write_bytes(BINARY)
    git(outer, "init", "-q")
    return repo


@pytest.fixture
def git_repo(tmp_path: Path) -> tuple[Path, str, str]:
    """A git repository with two commits: (path, first commit, second commit)."""
    repo = tmp_path / "origin"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("first\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    first = git(repo, "rev-parse", "HEAD")
    (repo / "a.txt").write_text("second\n")
    (repo / "b.txt").write_text("added later\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "two")
    return repo, first, git(repo, "rev-parse", "HEAD")


def fresh_checkout(handle: LocalHandle, into: Path) -> Path:
    """A new clone of the handle's workspace at its base commit (what a reviewer would apply the patch to)."""
    subprocess.run(["git", "clone", "-q", handle.workspace, str(into)], check=True)
    git(into, "checkout", "-q", "--detach", handle.base_commit)
    return into


async def test_plain_directory_becomes_a_committed_workspace(runtime: LocalRuntime, plain_repo: Path) -> None:
    handle = await runtime.init("s-plain", RuntimeSpec(repo=str(plain_repo)), timeout_s=60)
    try:
        workspace = Path(handle.workspace)
        assert (workspace / "src" / "calc.py").read_text() == (plain_repo / "src" / "calc.py").read_text()
        assert (workspace / "logo.bin").read_bytes() == BINARY
        assert git(workspace, "rev-parse", "HEAD") == handle.base_commit
        assert git(workspace, "status", "--porcelain") == ""
        assert Path(handle.home).is_dir() and Path(handle.home).parent == workspace.parent
        assert await handle.patch() == ""
        assert not (plain_repo / ".git").exists(), "the source directory must be left as it was"
    finally:
        await handle.teardown()


async def test_git_repository_is_checked_out_at_the_base_commit(runtime: LocalRuntime,
                                                                git_repo: tuple[Path, str, str]) -> None:
    repo, first, second = git_repo
    at_first = await runtime.init("s-first", RuntimeSpec(repo=str(repo), base_commit=first), timeout_s=60)
    at_head = await runtime.init("s-head", RuntimeSpec(repo=str(repo)), timeout_s=60)
    try:
        assert at_first.base_commit == first and at_head.base_commit == second
        assert (Path(at_first.workspace) / "a.txt").read_text() == "first\n"
        assert not (Path(at_first.workspace) / "b.txt").exists()
        assert (Path(at_head.workspace) / "b.txt").read_text() == "added later\n"
        assert at_first.workspace != at_head.workspace
    finally:
        await at_first.teardown()
        await at_head.teardown()


async def test_a_git_url_is_cloned(runtime: LocalRuntime, git_repo: tuple[Path, str, str]) -> None:
    repo, first, _ = git_repo
    handle = await runtime.init("s-url", RuntimeSpec(repo=f"file://{repo}", base_commit=first), timeout_s=60)
    try:
        assert (Path(handle.workspace) / "a.txt").read_text() == "first\n"
    finally:
        await handle.teardown()


async def test_setup_commands_run_in_the_workspace_with_the_runtime_env(runtime: LocalRuntime,
                                                                        plain_repo: Path) -> None:
    spec = RuntimeSpec(repo=str(plain_repo), env={"GREETING": "hi"},
                       setup=["echo \"$GREETING\" > from-setup.txt", "echo \"$HOME\" > home.txt"])
    handle = await runtime.init("s-setup", spec, timeout_s=60)
    try:
        workspace = Path(handle.workspace)
        assert (workspace / "from-setup.txt").read_text() == "hi\n"
        assert (workspace / "home.txt").read_text().strip() == handle.home
    finally:
        await handle.teardown()


async def test_failing_setup_raises_with_the_command_and_output(runtime: LocalRuntime, plain_repo: Path) -> None:
    spec = RuntimeSpec(repo=str(plain_repo), setup=["true", "echo no-such-tool >&2; exit 3"])
    with pytest.raises(RuntimeInitError) as caught:
        await runtime.init("s-bad-setup", spec, timeout_s=60)
    message = str(caught.value)
    assert "exit 3" in message and "exited 3" in message and "no-such-tool" in message
    assert list(runtime.root.iterdir()) == [], "a failed init leaves nothing behind"


async def test_bad_repository_and_base_commit_raise(runtime: LocalRuntime, git_repo: tuple[Path, str, str],
                                                    plain_repo: Path, tmp_path: Path) -> None:
    repo, _, _ = git_repo
    with pytest.raises(RuntimeInitError, match="0123456789abcdef"):
        await runtime.init("s-bad-commit", RuntimeSpec(repo=str(repo), base_commit="0123456789abcdef"), timeout_s=60)
    with pytest.raises(RuntimeInitError, match="not a git repository"):
        await runtime.init("s-plain-commit", RuntimeSpec(repo=str(plain_repo), base_commit="HEAD"), timeout_s=60)
    with pytest.raises(RuntimeInitError):
        await runtime.init("s-missing", RuntimeSpec(repo=str(tmp_path / "missing")), timeout_s=60)
    assert list(runtime.root.iterdir()) == []


async def test_run_passes_exactly_the_env_plus_home_and_path(runtime: LocalRuntime) -> None:
    os.environ["ROLLWIRE_TEST_LEAK"] = "leaked"
    handle = await runtime.init("s-env", RuntimeSpec(env={"FROM_SPEC": "spec"}), timeout_s=60)
    try:
        result = await handle.run(["sh", "-c", "env; pwd; cat"], env={"ONLY": "this"}, timeout_s=30,
                                  stdin="from stdin\n")
        assert result.exit_code == 0 and not result.timed_out
        env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
        assert env["ONLY"] == "this" and env["FROM_SPEC"] == "spec" and env["HOME"] == handle.home
        assert env["PATH"] == os.environ["PATH"]
        assert "ROLLWIRE_TEST_LEAK" not in env
        assert handle.workspace in result.stdout.splitlines() and "from stdin" in result.stdout
        own_path = await handle.run(["/bin/sh", "-c", "echo $PATH"], env={"PATH": "/bin:/usr/bin"}, timeout_s=30)
        assert own_path.stdout.strip() == "/bin:/usr/bin"
        failed = await handle.run(["sh", "-c", "echo oops >&2; exit 7"], env={}, timeout_s=30)
        assert failed.exit_code == 7 and failed.stderr.strip() == "oops"
    finally:
        os.environ.pop("ROLLWIRE_TEST_LEAK")
        await handle.teardown()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def gone(pid: int, within_s: float = 10) -> bool:
    """The process is gone (or a zombie) within ``within_s``: a SIGKILL lands asynchronously."""
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return not alive(pid)


async def wait_for_file(path: Path, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.05)
    return path.read_text()


# A parent that starts a child which sleeps (and ignores SIGTERM), records the child's pid, and waits.
SLEEPER = "sh -c 'trap \"\" TERM; sleep 300' & echo $! > child.pid; wait"


async def test_timeout_kills_the_process_group(runtime: LocalRuntime) -> None:
    handle = await runtime.init("s-timeout", RuntimeSpec(), timeout_s=60)
    try:
        result = await handle.run(["sh", "-c", f"echo started; {SLEEPER}"], env={}, timeout_s=1.5)
        assert result.timed_out and result.exit_code is None
        assert "started" in result.stdout
        child = int((Path(handle.workspace) / "child.pid").read_text())
        assert await gone(child), "the sleeping child outlived its timed-out parent"
    finally:
        await handle.teardown()


async def test_cancellation_kills_the_process_group(runtime: LocalRuntime) -> None:
    handle = await runtime.init("s-cancel", RuntimeSpec(), timeout_s=60)
    try:
        run = asyncio.ensure_future(handle.run(["sh", "-c", SLEEPER], env={}, timeout_s=300))
        child = int(await wait_for_file(Path(handle.workspace) / "child.pid"))
        assert alive(child)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert await gone(child), "the sleeping child outlived its cancelled run"
    finally:
        await handle.teardown()


async def test_background_children_do_not_outlive_a_finished_run(runtime: LocalRuntime) -> None:
    """A harness that exits while a child it started still holds its stdout must not block the run."""
    handle = await runtime.init("s-straggler", RuntimeSpec(), timeout_s=60)
    try:
        result = await handle.run(["sh", "-c", "sleep 300 & echo $! > child.pid; echo done"], env={}, timeout_s=60)
        assert result.exit_code == 0 and result.stdout.strip() == "done" and result.duration_s < 60
        assert await gone(int((Path(handle.workspace) / "child.pid").read_text()))
    finally:
        await handle.teardown()


async def test_patch_applies_to_a_fresh_checkout_without_harness_files(runtime: LocalRuntime, plain_repo: Path,
                                                                       tmp_path: Path) -> None:
    (plain_repo / ".gitignore").write_text("*.log\n")
    (plain_repo / "kept.log").write_text("tracked although ignored\n")
    handle = await runtime.init("s-patch", RuntimeSpec(repo=str(plain_repo)), timeout_s=60)
    workspace = Path(handle.workspace)
    try:
        (workspace / "src" / "calc.py").write_text("def add(a, b):\n    return a + b\n")   # modified
        (workspace / "README.md").unlink()                                                   # deleted
        (workspace / "src" / "new_module.py").write_text("VALUE = 1\n")                     # new
        (workspace / "data.bin").write_bytes(BINARY[::-1])                                  # new binary
        (workspace / "logo.bin").write_bytes(BINARY + b"\x00\xff")                          # modified binary
        (workspace / "kept.log").write_text("changed\n")                                    # tracked, ignored
        (workspace / "fresh.log").write_text("new and ignored\n")                           # untracked, ignored
        for junk in (".codex/config.toml", ".qwen/settings.json", ".claude/x.json", ".pi/agent/models.json",
                     ".gemini/settings.json", "node_modules/pkg/index.js", "src/__pycache__/calc.cpython-311.pyc",
                     "src/calc.pyc", ".pytest_cache/v/cache", ".venv/bin/python", "build/lib/x.py", "dist/x.whl"):
            (workspace / junk).parent.mkdir(parents=True, exist_ok=True)
            (workspace / junk).write_text("harness or build output\n")
        # The harness's own index and commits are not disturbed, and do not change what the patch holds.
        git(workspace, "add", "src/calc.py")
        git(workspace, "commit", "-qm", "the harness commits")
        (workspace / "staged.txt").write_text("staged by the harness\n")
        git(workspace, "add", "staged.txt")
        index_before = git(workspace, "diff", "--cached", "--name-only")

        patch = await handle.patch()

        assert git(workspace, "diff", "--cached", "--name-only") == index_before == "staged.txt"
        files = {line.split(" b/")[-1] for line in patch.splitlines() if line.startswith("diff --git")}
        assert files == {"src/calc.py", "README.md", "src/new_module.py", "data.bin", "logo.bin", "kept.log",
                         "staged.txt"}
        assert "GIT binary patch" in patch

        checkout = fresh_checkout(handle, tmp_path / "review")
        (tmp_path / "session.patch").write_text(patch)
        subprocess.run(["git", "apply", "--index", str(tmp_path / "session.patch")], cwd=checkout, check=True)
        assert (checkout / "src" / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
        assert not (checkout / "README.md").exists()
        assert (checkout / "src" / "new_module.py").read_text() == "VALUE = 1\n"
        assert (checkout / "data.bin").read_bytes() == BINARY[::-1]
        assert (checkout / "logo.bin").read_bytes() == BINARY + b"\x00\xff"
        assert (checkout / "kept.log").read_text() == "changed\n"
        assert not any((checkout / junk.split("/**")[0].removeprefix("**/")).exists()
                       for junk in PATCH_EXCLUDES if "*." not in junk)
    finally:
        await handle.teardown()


async def test_teardown_removes_everything_and_is_idempotent(runtime: LocalRuntime, plain_repo: Path) -> None:
    handle = await runtime.init("s-teardown", RuntimeSpec(repo=str(plain_repo)), timeout_s=60)
    await handle.write_home_files({".config/tool/settings.json": "{}", "top.txt": "x"})
    assert (Path(handle.home) / ".config" / "tool" / "settings.json").read_text() == "{}"
    read_only = Path(handle.workspace) / "locked"
    read_only.mkdir()
    (read_only / "file").write_text("x")
    read_only.chmod(0o500)
    await handle.teardown()
    await handle.teardown()
    assert not handle.root.exists() and list(runtime.root.iterdir()) == []


async def test_home_files_stay_under_home(runtime: LocalRuntime) -> None:
    handle = await runtime.init("s-home", RuntimeSpec(), timeout_s=60)
    try:
        for bad in ("../escape.txt", "/etc/passwd", "a/../../b"):
            with pytest.raises(ValueError):
                await handle.write_home_files({bad: "x"})
    finally:
        await handle.teardown()


def test_registry_knows_both_kinds() -> None:
    assert runtime_for("local").kind == "local" and runtime_for("docker").kind == "docker"
    with pytest.raises(ValueError, match="unknown runtime kind"):
        runtime_for("vm")


# -- docker ------------------------------------------------------------------------------------------

def test_mounts_parse() -> None:
    assert parse_mount("/data:/mnt/data:ro").volume() == {"bind": "/mnt/data", "mode": "ro"}
    mount = parse_mount("/cache:/root/.cache")
    assert (mount.host, mount.container, mount.read_only) == ("/cache", "/root/.cache", False)
    assert parse_mount("~/x:/x").host == os.path.expanduser("~/x")
    for bad in ("/only-one", "relative:/x", "/x:relative", "/a:/b:rx", "/a:/b:ro:extra", ":/b"):
        with pytest.raises(ValueError):
            parse_mount(bad)


def test_relay_containers_reach_the_proxy_on_their_own_loopback() -> None:
    assert RELAY_PORT == 18080
    assert relay_url("http://127.0.0.1:8100") == "http://127.0.0.1:18080"
    assert relay_url("http://localhost:8100/s/x/v1") == "http://127.0.0.1:18080/s/x/v1"
    assert relay_url("http://[::1]:9000/") == "http://127.0.0.1:18080/"
    assert relay_url("http://proxy.internal:8100/p?q=1") == "http://127.0.0.1:18080/p?q=1"
    assert relay_url("http://u:pw@10.0.0.5") == "http://u:pw@127.0.0.1:18080"
    # Runtimes say the URL unchanged; the handle decides (a relay container's is its own loopback).
    assert runtime_for("docker").proxy_url_for("http://127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert runtime_for("local").proxy_url_for("http://127.0.0.1:8100") == "http://127.0.0.1:8100"


async def test_docker_volumes_hold_workspace_home_relay_and_spec_mounts(tmp_path: Path) -> None:
    runtime = DockerRuntime(tmp_path, mount_harness_cache=False)
    spec = RuntimeSpec(kind="docker", image="rollwire/base:bookworm", repo="/src", network="none",
                       mounts=["/data:/mnt/data:ro"])
    volumes = runtime.volumes(spec, tmp_path / "s1", "/workspace")
    assert volumes == {str(tmp_path / "s1" / "workspace"): {"bind": "/workspace", "mode": "rw"},
                       str(tmp_path / "s1" / "home"): {"bind": "/rollwire/home", "mode": "rw"},
                       str(RELAY_SCRIPT): {"bind": CONTAINER_RELAY_SCRIPT, "mode": "ro"},
                       "/data": {"bind": "/mnt/data", "mode": "ro"}}
    in_image = runtime.volumes(spec.model_copy(update={"repo": None, "network": "relay", "mounts": []}),
                               tmp_path / "s2", "/testbed")
    assert in_image == {str(tmp_path / "s2" / "home"): {"bind": "/rollwire/home", "mode": "rw"},
                        str(tmp_path / "s2" / "run"): {"bind": "/rollwire/run", "mode": "rw"},
                        str(RELAY_SCRIPT): {"bind": CONTAINER_RELAY_SCRIPT, "mode": "ro"}}
    assert RELAY_SCRIPT.is_file()
    with pytest.raises(RuntimeInitError, match="mode must be"):
        await runtime.init("s-bad-mount", spec.model_copy(update={"mounts": ["/a:/b:rx"]}), timeout_s=30)
    assert list(tmp_path.iterdir()) == []


def test_docker_spec_limits_are_checked() -> None:
    spec = RuntimeSpec(kind="docker", image="x", cpus=1.5, memory="512m", pids_limit=64)
    assert (spec.network, spec.cpus, spec.memory, spec.pids_limit) == ("relay", 1.5, "512m", 64)
    assert RuntimeSpec(kind="docker", image="x").pids_limit is None
    for bad in ({"memory": "1.5g"}, {"memory": "2gb"}, {"memory": "lots"}, {"memory": "1m"}, {"cpus": 0},
                {"pids_limit": 0}, {"network": "bridge"}):
        with pytest.raises(ValueError):
            RuntimeSpec(kind="docker", image="x", **bad)
    with pytest.raises(ValueError, match="needs runtime.image"):
        RuntimeSpec(kind="docker")
