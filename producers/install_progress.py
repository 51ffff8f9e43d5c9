"""Progress lines for long installs (pip, npm): what is being installed, how far, and how long so far.

A first start installs vLLM's CPU environment (``deploy/engine/vllm_env.py``: about 3.3 GB downloaded,
6 GB on disk) and the harness CLIs from npm (``producers/harness_install.py``); each runs for minutes.
``watch`` runs the installer with its output piped (every line still goes to the caller's log and to the
tail kept for an error message), feeds each line to a parser of that tool's own output (``PipOutput``,
``NpmOutput``), and a ``Reporter`` turns what the parser knows into lines such as::

    [vllm env 1m32s] installing 143 packages; 2.1 GB of about 6.0 GB on disk

one at once for each phase change (collecting → installing → installed), otherwise at most one every
``interval_s`` (10 s), also while the installer itself prints nothing (a 500 MB wheel downloading, pip
unpacking 5 GB). Lines go to stderr unless the caller passes its own ``emit`` (a logger, a console).

It lives in producers because ``harness_install`` needs it and producers import only schemas and
themselves; deploy (above producers) uses it for vLLM's environment.
"""

from __future__ import annotations

import fcntl
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import unquote, urlsplit

Emit = Callable[[str], None]
DEFAULT_INTERVAL_S = 10.0
_POLL_S = 1.0  # how often a silent installer is looked at


def to_stderr(line: str) -> None:
    """The default ``Emit``: one line on stderr, flushed (the terminal of ``rollwire up`` / ``rollout``)."""
    print(line, file=sys.stderr, flush=True)


def format_elapsed(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def format_bytes(size: float) -> str:
    """Decimal units, as pip and npm print them: ``310 kB``, ``527 MB``, ``2.1 GB``."""
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    if size >= 1e6:
        return f"{size / 1e6:.0f} MB"
    if size >= 1e3:
        return f"{size / 1e3:.0f} kB"
    return f"{int(size)} B"


def dir_bytes(path: Path) -> int:
    """Bytes a directory tree takes on disk (allocated blocks, as ``du``); 0 if it does not exist.

    Files that vanish while it walks (pip replaces files as it installs) are skipped. About 0.3 s for
    vLLM's 56,000 files, so callers measure only when a line is due.
    """
    total = 0
    stack = [os.fspath(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


@contextmanager
def install_lock(path: Path, waiting: Callable[[str], str], say: Callable[[str], None]) -> Iterator[None]:
    """Hold the lock file ``path`` for one install, so that two processes never install into one place.

    While another process holds it, ``say`` is given ``waiting(holder)`` once (``holder``: what the lock file
    names, ``pid N``, or "another process") and the call waits. The holder writes its own pid there."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            say(waiting(handle.read().strip() or "another process"))
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}\n")
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Reporter:
    """Writes ``[<label> <elapsed>] <text>`` lines: ``say`` at once (a phase change), ``update`` only when
    ``interval_s`` has passed since the last line, so that a long phase shows it is alive without
    flooding a terminal or a test's output."""

    def __init__(self, label: str, emit: Emit | None = None, *, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.emit = emit or to_stderr
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self._last: float | None = None

    def elapsed(self) -> float:
        return self.clock() - self.started

    def say(self, text: str) -> None:
        """Emit a line now (the start of a phase, a result)."""
        self._last = self.clock()
        self.emit(f"[{self.label} {format_elapsed(self._last - self.started)}] {text}")

    def due(self) -> bool:
        """Whether an ``update`` would emit now."""
        return self._last is None or self.clock() - self._last >= self.interval_s

    def update(self, text: str | Callable[[], str]) -> bool:
        """Emit ``text`` if a line is due; a callable is only called then (it may measure a directory)."""
        if not self.due():
            return False
        self.say(text() if callable(text) else text)
        return True


class OutputParser(Protocol):
    """Reads an installer's output line by line."""

    def feed(self, line: str) -> str | None:
        """Take one line; return the description of the phase it starts, or None."""

    def status(self) -> str:
        """Where the install stands now, in a few words."""


@dataclass
class PlainOutput:
    """For a step whose output says nothing about progress (``python -m venv``, an import check)."""

    what: str

    def feed(self, line: str) -> str | None:
        return None

    def status(self) -> str:
        return f"{self.what}: still running"


_SIZE = re.compile(r"\s\((\d+(?:\.\d+)?) (bytes|kB|MB|GB)\)\s*$")
_UNITS = {"bytes": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9}
_ARCHIVE = re.compile(r"\.(whl|tar\.gz|tar\.bz2|tgz|zip)$")


def artifact_name(location: str) -> str:
    """``torch 2.13.0`` for ``torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl`` (or a URL to it); the
    name unchanged where it is no wheel or sdist file name."""
    name = unquote(urlsplit(location).path.rsplit("/", 1)[-1]) or location
    match = _ARCHIVE.search(name)
    if match is None:
        return name
    stem = name[: match.start()]
    if match.group(1) == "whl":
        parts = stem.split("-")
        return f"{parts[0]} {parts[1]}" if len(parts) >= 2 else stem
    base, _, version = stem.rpartition("-")
    return f"{base} {version}" if base else stem


@dataclass
class PipOutput:
    """pip's own output (``pip install`` without ``--quiet``, with ``--progress-bar off``), pip 23 to 26.

    Phases: ``collecting`` (``Collecting …`` / ``Processing …``, each followed by ``Downloading <file>
    (<size>)`` or ``Using cached …``), ``building`` (``Building wheels for collected packages: …``),
    ``installing`` (``Installing collected packages: a, b, …``; pip says nothing more until it is done),
    ``installed`` (``Successfully installed a-1 b-2``) and, for ``--dry-run``, ``resolved`` (``Would
    install …``).
    """

    phase: str = "starting"
    collected: int = 0
    downloads: int = 0
    announced_bytes: float = 0.0  # the sizes pip printed for the files it fetched (or took from its cache)
    current: str = ""
    to_install: int = 0
    to_build: int = 0
    installed: int = 0

    def feed(self, line: str) -> str | None:
        text = line.strip()
        for prefix, verb in (("Downloading ", "downloading"), ("Using cached ", "using cached")):
            if text.startswith(prefix):
                self._fetch(verb, text[len(prefix):])
                return self._enter("collecting")
        for prefix in ("Collecting ", "Processing "):
            if text.startswith(prefix):
                self.collected += 1
                target = text[len(prefix):].split(" (from ", 1)[0]
                self.current = f"collecting {artifact_name(target) if prefix == 'Processing ' else target}"
                return self._enter("collecting")
        if text.startswith("Requirement already satisfied: "):
            self.collected += 1
            return self._enter("collecting")
        if text.startswith("Building wheels for collected packages:"):
            self.to_build = len(_names(text.partition(":")[2], ","))
            return self._enter("building")
        if text.startswith("Installing collected packages:"):
            self.to_install = len(_names(text.partition(":")[2], ","))
            self.current = ""
            return self._enter("installing")
        if text.startswith("Attempting uninstall:"):
            self.current = f"replacing {text.partition(':')[2].strip()}"
            return None
        if text.startswith("Successfully installed "):
            self.installed = len(_names(text[len("Successfully installed "):], None))
            return self._enter("installed")
        if text.startswith("Would install "):
            self.to_install = len(_names(text[len("Would install "):], None))
            return self._enter("resolved")
        return None

    def _fetch(self, verb: str, rest: str) -> None:
        size = _SIZE.search(rest)
        location = rest[: size.start()] if size else rest
        if location.endswith(".metadata"):  # pip >= 23.3 reads a wheel's metadata first (PEP 658)
            return
        self.downloads += 1
        if size:
            self.announced_bytes += float(size.group(1)) * _UNITS[size.group(2)]
            self.current = f"{verb} {artifact_name(location)} ({size.group(1)} {size.group(2)})"
        else:
            self.current = f"{verb} {artifact_name(location)}"

    def _enter(self, phase: str) -> str | None:
        if phase == self.phase:
            return None
        self.phase = phase
        if phase == "collecting":  # pip resolves as it goes: no total is known before it installs
            first = self.current.removeprefix("collecting ")
            return f"collecting packages, first {first}" if first else "collecting packages"
        return self.status()

    def status(self) -> str:
        if self.phase == "collecting":
            text = f"collecting packages: {self.collected} so far"
            return f"{text}, now {self.current}" if self.current else text
        if self.phase == "building":
            return f"building wheels for {_count(self.to_build, 'package')}"
        if self.phase == "installing":
            text = f"installing {_count(self.to_install, 'package')}"
            return f"{text} ({self.current})" if self.current else text
        if self.phase == "installed":
            return f"installed {_count(self.installed, 'package')}"
        if self.phase == "resolved":
            return f"would install {_count(self.to_install, 'package')}"
        return "pip is starting"


def _names(text: str, separator: str | None) -> list[str]:
    return [name.strip() for name in text.split(separator) if name.strip()]


_NPM_FETCH = re.compile(r"^npm http fetch GET (\d{3}) (\S+)")
_NPM_CACHE = re.compile(r"^npm http cache (\S+?)@(https?://\S+) ")
_NPM_DONE = re.compile(r"^(added|removed|changed|up to date)\b")


@dataclass
class NpmOutput:
    """npm's output at ``--loglevel=http`` (npm 10 and 11).

    Phases: ``resolving`` (``npm http fetch GET 200 <registry>/<package>``: one manifest per package it
    looks at, optional platform packages included), ``unpacking`` (``npm http cache <name>@<tarball>``, one
    line for each package it is going to add, then ``npm http fetch GET 200 <…>.tgz`` as each tarball
    arrives; none for a tarball already in npm's cache) and ``done`` (``added 11 packages in 7s``). A 404 is
    npm probing an optional package that does not exist; it is not counted.
    """

    phase: str = "starting"
    manifests: int = 0
    planned: set[str] = field(default_factory=set)
    tarballs: int = 0
    current: str = ""
    summary: str = ""

    def feed(self, line: str) -> str | None:
        text = line.strip()
        fetch = _NPM_FETCH.match(text)
        if fetch is not None:
            if fetch.group(1) != "200":
                return None
            path = unquote(urlsplit(fetch.group(2)).path).lstrip("/")
            if "/-/" in path:
                package, _, tarball = path.partition("/-/")
                self.tarballs += 1
                self.current = f"downloaded {package} {_tarball_version(package, tarball)}".rstrip()
                return self._enter("unpacking")
            self.manifests += 1
            self.current = path
            return self._enter("resolving")
        cache = _NPM_CACHE.match(text)
        if cache is not None and cache.group(2).endswith(".tgz"):
            self.planned.add(cache.group(1))
            return self._enter("unpacking")
        if _NPM_DONE.match(text):
            self.summary = text
            return self._enter("done")
        return None

    def _enter(self, phase: str) -> str | None:
        if phase == self.phase:
            return None
        self.phase = phase
        if phase == "resolving":
            return "resolving dependencies"
        if phase == "unpacking":
            return "downloading and unpacking packages"
        return self.status()

    def status(self) -> str:
        if self.phase == "resolving":
            return f"resolving dependencies: {_count(self.manifests, 'package manifest')} fetched, now {self.current}"
        if self.phase == "unpacking":
            text = (f"downloading and unpacking {_count(len(self.planned), 'package')}: "
                    f"{_count(self.tarballs, 'tarball')} downloaded")
            return f"{text}, last {self.current}" if self.current.startswith("downloaded") else text
        if self.phase == "done":
            return self.summary
        return "npm is starting"


def _tarball_version(package: str, tarball: str) -> str:
    base = package.rsplit("/", 1)[-1]
    stem = tarball[:-4] if tarball.endswith(".tgz") else tarball
    return stem[len(base) + 1:] if stem.startswith(base + "-") else ""


@dataclass(frozen=True)
class Finished:
    """How a watched command ended: its exit status and the last lines of its output."""

    returncode: int
    tail: list[str]


def watch(command: Sequence[str], parser: OutputParser, reporter: Reporter, *, log: IO[str] | None = None,
          timeout_s: float | None = None, env: Mapping[str, str] | None = None, cwd: Path | None = None,
          measure: Callable[[], str | None] | None = None, tail_lines: int = 40) -> Finished:
    """Run ``command`` (stdout and stderr together), copying its output to ``log`` and reporting progress.

    Each phase ``parser`` sees starts a line at once; otherwise ``reporter`` gets the parser's status at
    most every ``interval_s``, with ``measure()`` appended (called only then). Raises OSError if the
    command cannot start and ``subprocess.TimeoutExpired`` (after killing it) past ``timeout_s``.
    """
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, text=True, encoding="utf-8", errors="replace",
                               bufsize=1, env=dict(env) if env is not None else None, cwd=cwd)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True,
                     name=f"watch-{os.path.basename(command[0])}").start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    tail: deque[str] = deque(maxlen=tail_lines)

    def describe() -> str:
        extra = measure() if measure is not None else None
        return f"{parser.status()}; {extra}" if extra else parser.status()

    try:
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(list(command), timeout_s or 0)
            try:
                line = lines.get(timeout=_POLL_S if remaining is None else min(_POLL_S, remaining))
            except queue.Empty:
                reporter.update(describe)
                continue
            if line is None:
                break
            if log is not None:
                log.write(line if line.endswith("\n") else line + "\n")
                log.flush()
            tail.append(line.rstrip("\n"))
            started = parser.feed(line)
            if started is not None:
                reporter.say(started)
            else:
                reporter.update(describe)
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.1)
        returncode = process.wait(timeout=remaining)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return Finished(returncode, list(tail))


def _pump(stream: IO[str] | None, lines: queue.Queue[str | None]) -> None:
    try:
        if stream is not None:
            with stream:
                for line in stream:
                    lines.put(line)
    finally:
        lines.put(None)
