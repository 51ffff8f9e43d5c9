"""The container images rollwire's sessions run in, built offline on this machine (no registry is needed).

``rollwire images build`` builds, in order, each only when its inputs changed:

* ``rollwire/base:bookworm`` — a Debian bookworm root made by ``debootstrap --variant=minbase`` with
  git, python3, python3-pytest, ca-certificates, patch, procps and libstdc++6, imported into Docker
  (``rollwire/rootfs:bookworm``), plus this machine's own Node.js binary (Node 20 or newer; Debian's
  nodejs 18 is below the harness CLIs' floors) at ``/usr/local/bin/node``. The root file system's
  tarball is cached under ``<cache>/images/`` keyed by suite, architecture and package list.
* ``rollwire/harnesses:latest`` — FROM base, with the pinned harness CLIs (``producers.harness_install``
  installs any that are missing into ``harness_cache()`` first) copied into the image at that same
  absolute path, so an adapter's argv works unchanged inside. Labels ``rollwire.harness_cache`` (the
  path) and ``rollwire.harness_pins`` (``name=version,...``).
* ``rollwire/swe-<slug>:latest`` (or the instance's ``image_name``) for each instance of an instances
  file (default ``examples/swebench/instances.jsonl``): FROM harnesses, the instance's repository
  (``<file's folder>/repos/<instance_id>/``) at ``/testbed``, committed by :func:`commit_repository`;
  the build fails when that commit is not the instance's ``base_commit``.

Every image carries ``rollwire.inputs``, a digest of what it is made from (its Dockerfile, the package
list, the Node binary's sha256, the pins, the repository's files, the parent's digest). An image whose
label matches is not rebuilt (``--force`` rebuilds); a changed base rebuilds everything above it.

Needs: a Docker engine (``deploy.docker_engine.ensure_engine`` adopts one or starts rollwire's own
``dockerd``), ``debootstrap`` (``apt-get install -y docker.io debootstrap``), the Debian mirror this
machine's apt sources name (default ``http://deb.debian.org/debian``), root (debootstrap), Node.js 20+ at
``/usr/bin/node`` (or on PATH) and, for CLIs not yet installed, npm and its registry. A cold base is
mostly debootstrap's time (its root tarball is then cached under the cache's ``images/``); a second
``build`` with nothing changed only computes digests (the Node binary hashed once).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from deploy.docker_engine import cache_dir, client_for, ensure_engine
from deploy.errors import DeployError, MissingToolError
from deploy.kafka_dist import file_lock
from producers.harness_install import HARNESSES, HarnessInstallError, ensure_harness, harness_cache
from schemas.swebench import SwebenchInstance, local_image_name, read_instances

Say = Callable[[str], None]

SUITE = "bookworm"
ROOTFS_IMAGE = f"rollwire/rootfs:{SUITE}"
BASE_IMAGE = f"rollwire/base:{SUITE}"
HARNESS_IMAGE = "rollwire/harnesses:latest"
BASE_PACKAGES = ("git", "python3", "python3-pytest", "ca-certificates", "patch", "procps", "libstdc++6")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
TESTBED = "/testbed"
DEFAULT_INSTANCES = Path(__file__).resolve().parents[1] / "examples" / "swebench" / "instances.jsonl"

LABEL_INPUTS = "rollwire.inputs"
LABEL_HARNESS_CACHE = "rollwire.harness_cache"
LABEL_HARNESS_PINS = "rollwire.harness_pins"
LABEL_INSTANCE = "rollwire.instance_id"
LABEL_BASE_COMMIT = "rollwire.base_commit"

# The deterministic commit of a local example repository (same tree -> same hash on every machine).
COMMIT_DATE = "2026-01-01T00:00:00+0000"
COMMIT_IDENTITY = {"GIT_AUTHOR_NAME": "rollwire", "GIT_AUTHOR_EMAIL": "examples@rollwire.invalid",
                   "GIT_AUTHOR_DATE": COMMIT_DATE, "GIT_COMMITTER_NAME": "rollwire",
                   "GIT_COMMITTER_EMAIL": "examples@rollwire.invalid", "GIT_COMMITTER_DATE": COMMIT_DATE}
# Left out of the copy: an existing repository, and what running Python or pytest in the folder leaves.
_NOT_SOURCE = (".git", "__pycache__", ".pytest_cache", "*.pyc")

_DEBOOTSTRAP_TIMEOUT_S = 1200.0
_REPORT_EVERY_S = 10.0
_ERROR_TAIL_CHARS = 3000
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_BASE_DOCKERFILE = f"""FROM {ROOTFS_IMAGE}
COPY node /usr/local/bin/node
ENV PATH={_PATH} LANG=C.UTF-8
WORKDIR /
CMD ["/bin/bash"]
"""
_SWE_DOCKERFILE = f"""FROM {HARNESS_IMAGE}
COPY testbed {TESTBED}
WORKDIR {TESTBED}
"""


class ImageBuildError(DeployError):
    """An image could not be built: a tool is missing, debootstrap or a build failed, or a check failed."""


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _tail(text: str) -> str:
    return text[-_ERROR_TAIL_CHARS:]


# --- the deterministic base commit ---------------------------------------------------------------------


def _git(args: Sequence[str], cwd: Path) -> str:
    env = {**os.environ, **COMMIT_IDENTITY, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ImageBuildError(f"git {' '.join(args)} in {cwd} failed: {_tail(done.stderr or done.stdout)}")
    return done.stdout.strip()


def commit_repository(src: Path, dest: Path) -> str:
    """Copy ``src`` to ``dest`` (absent or empty) as a git repository with one deterministic commit; its hash.

    The copy leaves out ``.git``, ``__pycache__``, ``.pytest_cache`` and ``*.pyc``; files get mode 644
    and folders 755 (symbolic links are kept as links); then ``git init -q -b main``, ``git add -A`` and
    ``git -c commit.gpgsign=false commit -q -m base`` as rollwire <examples@rollwire.invalid> at
    2026-01-01T00:00:00+0000 (author and committer), with no global or system git configuration. The same
    tree gives the same hash wherever it is copied from or to.
    """
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise ImageBuildError(f"repository source {src} is not a folder")
    if dest.exists() and any(dest.iterdir()):
        raise ImageBuildError(f"{dest} is not empty")
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(*_NOT_SOURCE), dirs_exist_ok=True)
    for folder, dirs, files in os.walk(dest):
        os.chmod(folder, 0o755)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)
    _git(["init", "-q", "-b", "main"], dest)
    _git(["add", "-A"], dest)
    _git(["-c", "commit.gpgsign=false", "commit", "-q", "-m", "base"], dest)
    return _git(["rev-parse", "HEAD"], dest)


def _tree_digest(src: Path) -> str:
    """A digest of the files :func:`commit_repository` would commit (paths, link targets, contents)."""
    digest = hashlib.sha256()
    ignore = shutil.ignore_patterns(*_NOT_SOURCE)
    for folder, dirs, files in os.walk(src):
        skipped = ignore(folder, dirs + files)
        dirs[:] = sorted(d for d in dirs if d not in skipped)
        for name in sorted(f for f in files if f not in skipped):
            path = Path(folder, name)
            digest.update(str(path.relative_to(src)).encode() + b"\0")
            digest.update(os.readlink(path).encode() if path.is_symlink() else _file_sha256(path).encode())
            digest.update(b"\0")
    return digest.hexdigest()


# --- the host's tools ------------------------------------------------------------------------------------


def debian_mirror(sources: Sequence[Path] = (Path("/etc/apt/sources.list.d/debian.sources"),
                                             Path("/etc/apt/sources.list"))) -> str:
    """The Debian mirror this machine's apt sources name for the main archive (not -security), else the default."""
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):  # deb822: URIs: ... / Suites: ...
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.MULTILINE)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.MULTILINE)
            if uris and suites and any(s == SUITE for s in suites.group(1).split()) and "security" not in uris.group(1):
                return uris.group(1).rstrip("/")
        for line in text.splitlines():  # one-line style: deb [opts] URI SUITE COMPONENTS
            words = [w for w in re.sub(r"\[[^\]]*\]", "", line).split()]
            if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE and "security" not in words[1]:
                return words[1].rstrip("/")
    return DEFAULT_MIRROR


def _debootstrap() -> str:
    found = shutil.which("debootstrap") or next(
        (p for p in ("/usr/sbin/debootstrap", "/sbin/debootstrap") if os.access(p, os.X_OK)), None)
    if found is None:
        raise MissingToolError("debootstrap is not installed: run `apt-get install -y debootstrap` (it makes "
                               "the Debian root of rollwire/base)")
    if os.geteuid() != 0:
        raise ImageBuildError("debootstrap must run as root to build rollwire/base")
    return found


def host_node() -> Path:
    """This machine's Node.js binary (``/usr/bin/node``, else ``node`` on PATH), checked to be 20 or newer."""
    candidates = [Path("/usr/bin/node")] + ([Path(p)] if (p := shutil.which("node")) else [])
    node = next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)
    if node is None:
        raise MissingToolError("Node.js is not installed: rollwire/base copies this machine's node binary "
                               "(Node 20, e.g. the nodesource package's /usr/bin/node)")
    version = subprocess.run([str(node), "--version"], capture_output=True, text=True).stdout.strip()
    major = re.match(r"v(\d+)\.", version)
    if major is None or int(major.group(1)) < 20:
        raise ImageBuildError(f"{node} is Node {version or '(unknown)'}; the harness CLIs need Node 20 or newer")
    return node.resolve()


def _architecture() -> str:
    try:
        return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return platform.machine()


# --- instances -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweImage:
    """One instance's image: its name, the repository folder it is built from and the expected commit."""

    instance_id: str
    image: str
    base_commit: str
    source: Path


def swe_images(instances_file: Path) -> list[SweImage]:
    """The image of each instance of ``instances_file``; sources at ``<its folder>/repos/<instance_id>/``."""
    try:
        good, bad = read_instances(instances_file)
    except OSError as exc:
        raise ImageBuildError(f"cannot read {instances_file}: {exc}") from exc
    if bad:
        raise ImageBuildError(f"{instances_file}: " + "; ".join(f"{b.where}: {b.error}" for b in bad[:5]))
    images = []
    for record in good:
        instance: SwebenchInstance = record.instance
        name = instance.image_name or local_image_name(instance.instance_id)
        source = instances_file.parent / "repos" / instance.instance_id
        images.append(SweImage(instance.instance_id, name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest",
                               instance.base_commit, source))
    return images


# --- building --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildResult:
    """What ``build`` did for one image: ``built`` or ``cached``, how long it took, the image id."""

    image: str
    status: str
    seconds: float
    image_id: str


@dataclass(frozen=True)
class ImageRow:
    """One rollwire image as ``images list`` shows it."""

    image: str
    image_id: str
    size_bytes: int
    created: str
    up_to_date: bool | None  # None: not one build makes (or its inputs cannot be computed here)


def _timed(say: Say, what: str) -> Callable[[], float]:
    """Say ``what`` now; the returned function says it is done with the time taken, and returns that."""
    started = time.monotonic()
    say(what)

    def done() -> float:
        seconds = time.monotonic() - started
        say(f"  done in {seconds:.1f} s")
        return seconds
    return done


class ImageBuilder:
    """Builds (or finds up to date) rollwire's images on one Docker engine."""

    def __init__(self, client: Any = None, cache: Path | None = None, say: Say = print) -> None:
        self.client = client if client is not None else client_for(ensure_engine(), timeout_s=3600)
        self.cache = cache or cache_dir()
        self.say = say
        self._digests: dict[str, str] = {}
        self._replaced: list[str] = []

    # inputs

    def rootfs_key(self) -> str:
        return _digest({"suite": SUITE, "variant": "minbase", "packages": sorted(BASE_PACKAGES),
                        "arch": _architecture()})[:16]

    def rootfs_tarball(self) -> Path:
        return self.cache / "images" / f"rootfs-{SUITE}-{self.rootfs_key()}.tar"

    def base_digest(self) -> str:
        if "base" not in self._digests:
            self._digests["base"] = _digest({"rootfs": self.rootfs_key(), "node": _file_sha256(host_node()),
                                             "dockerfile": _BASE_DOCKERFILE})
        return self._digests["base"]

    @staticmethod
    def harness_pins() -> str:
        return ",".join(f"{h.name}={h.version}" for h in sorted(HARNESSES.values(), key=lambda h: h.name))

    def _harness_dockerfile(self) -> str:
        cache = harness_cache()
        lines = [f"FROM {BASE_IMAGE}"]
        for spec in sorted(HARNESSES.values(), key=lambda h: h.name):
            prefix = f"{spec.name}-{spec.version}"
            lines.append(f"COPY {prefix} {cache / prefix}")
        return "\n".join(lines) + "\n"

    def harness_digest(self) -> str:
        if "harnesses" not in self._digests:
            self._digests["harnesses"] = _digest({"base": self.base_digest(), "pins": self.harness_pins(),
                                                  "cache": str(harness_cache()),
                                                  "dockerfile": self._harness_dockerfile()})
        return self._digests["harnesses"]

    def swe_digest(self, swe: SweImage) -> str:
        return _digest({"harnesses": self.harness_digest(), "base_commit": swe.base_commit,
                        "tree": _tree_digest(swe.source), "dockerfile": _SWE_DOCKERFILE})

    # engine helpers

    def _image(self, name: str) -> Any:
        try:
            return self.client.images.get(name)
        except Exception as exc:  # docker.errors.ImageNotFound
            if type(exc).__name__ == "ImageNotFound":
                return None
            raise

    def _cached(self, name: str, digest: str, force: bool) -> Any:
        image = self._image(name)
        if image is not None and not force and (image.labels or {}).get(LABEL_INPUTS) == digest:
            return image
        return None

    def _drop_replaced(self, old: Any, new_id: str) -> None:
        """Note the image a rebuild replaced (it would linger untagged); :meth:`prune_replaced` removes it."""
        if old is not None and old.id != new_id:
            self._replaced.append(str(old.id))

    def prune_replaced(self) -> None:
        """Remove the images rebuilds replaced, children first, each when nothing else uses it any more."""
        while self._replaced:
            try:
                self.client.images.remove(self._replaced.pop(), noprune=False)
            except Exception:  # still used by a container or by an image this build did not replace
                pass

    def _build(self, tag: str, dockerfile: str, entries: Sequence[tuple[Path, str]], labels: dict[str, str],
               renames: Sequence[tuple[str, str]] = ()) -> str:
        """``docker build`` of a context holding the Dockerfile and each (folder, name) entry, ``renames``
        (name in its folder, name in the context) applied; the image id.

        The context is streamed from ``tar`` (GNU tar copes with the CLIs' gigabyte of files far faster
        than Python's tarfile) straight into the engine's build API."""
        with tempfile.TemporaryDirectory(prefix="rollwire-build-") as scratch:
            Path(scratch, "Dockerfile").write_text(dockerfile)
            argv = ["tar", "--numeric-owner", "-c", "-f", "-"]
            argv += [f"--transform=s,^{re.escape(old)}$,{new}," for old, new in renames]
            argv += ["-C", scratch, "Dockerfile"]
            for folder, name in entries:
                argv += ["-C", str(folder), name]
            tar = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert tar.stdout is not None and tar.stderr is not None
            try:
                log = self._stream_build(tag, tar.stdout, labels)
            finally:
                tar.stdout.close()
                tar_error = tar.stderr.read().decode(errors="replace")
                tar.stderr.close()
                tar.wait()
            if tar.returncode != 0:
                raise ImageBuildError(f"building {tag}: tar of the build context failed: {_tail(tar_error)}")
        image = self._image(tag)
        if image is None:
            raise ImageBuildError(f"building {tag}: the engine reported no error but has no such image:\n{_tail(log)}")
        return str(image.id)

    def _stream_build(self, tag: str, context: IO[bytes], labels: dict[str, str]) -> str:
        log: list[str] = []
        try:
            for chunk in self.client.api.build(fileobj=context, custom_context=True, tag=tag, labels=labels,
                                               rm=True, forcerm=True, pull=False, decode=True):
                if "error" in chunk:
                    detail = chunk.get("errorDetail", {}).get("message") or chunk["error"]
                    raise ImageBuildError(f"building {tag} failed: {detail}\n{_tail(''.join(log))}")
                if "stream" in chunk:
                    log.append(chunk["stream"])
        except ImageBuildError:
            raise
        except Exception as exc:  # docker.errors.APIError, a broken connection
            raise ImageBuildError(f"building {tag}: {exc}\n{_tail(''.join(log))}") from exc
        return "".join(log)

    # the images

    def build_rootfs(self) -> Path:
        """The cached Debian root tarball, made with debootstrap when missing."""
        tarball = self.rootfs_tarball()
        if tarball.is_file():
            return tarball
        debootstrap = _debootstrap()
        mirror = debian_mirror()
        tarball.parent.mkdir(parents=True, exist_ok=True)
        done = _timed(self.say, f"[images] debootstrap --variant=minbase {SUITE} from {mirror} "
                                f"(+ {', '.join(BASE_PACKAGES)}); about 80 s")
        with tempfile.TemporaryDirectory(prefix="rootfs-", dir=tarball.parent) as scratch:
            root = Path(scratch, "root")
            self._run_debootstrap([debootstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                                   SUITE, str(root), mirror])
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):  # downloaded .debs, indexes
                for path in (root / leftover).glob("*"):
                    if path.is_file():
                        path.unlink()
            partial = Path(scratch, "rootfs.tar")
            tarred = subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-c", "-f", str(partial), "."],
                                    capture_output=True, text=True)
            if tarred.returncode != 0:
                raise ImageBuildError(f"tar of the Debian root failed: {_tail(tarred.stderr)}")
            partial.replace(tarball)
        done()
        self.say(f"  cached {tarball} ({tarball.stat().st_size / 1e6:.0f} MB)")
        return tarball

    def _run_debootstrap(self, argv: list[str]) -> None:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        started = last_report = time.monotonic()
        lines: list[str] = []
        for line in process.stdout:
            lines.append(line.rstrip())
            del lines[:-60]
            now = time.monotonic()
            if now - started > _DEBOOTSTRAP_TIMEOUT_S:
                process.kill()
                break
            if now - last_report >= _REPORT_EVERY_S and line.startswith("I: "):
                self.say(f"  [{now - started:.0f}s] {line[3:].strip()}")
                last_report = now
        code = process.wait()
        if code != 0:
            raise ImageBuildError(f"debootstrap failed (exit code {code}); check that the mirror "
                                  f"({argv[-1]}) is reachable. Its output ends:\n" + _tail("\n".join(lines)))

    def build_base(self, force: bool = False) -> BuildResult:
        started = time.monotonic()
        digest = self.base_digest()
        cached = self._cached(BASE_IMAGE, digest, force)
        if cached is not None:
            self.say(f"[images] {BASE_IMAGE}: up to date")
            return BuildResult(BASE_IMAGE, "cached", time.monotonic() - started, str(cached.id))
        tarball = self.build_rootfs()
        rootfs_key = self.rootfs_key()
        rootfs = self._image(ROOTFS_IMAGE)
        if force or rootfs is None or (rootfs.labels or {}).get(LABEL_INPUTS) != rootfs_key:
            if rootfs is not None:
                self._replaced.append(str(rootfs.id))
            done = _timed(self.say, f"[images] docker import {tarball.name} as {ROOTFS_IMAGE}")
            repository, tag = ROOTFS_IMAGE.split(":")
            try:
                self.client.api.import_image_from_file(
                    str(tarball), repository=repository, tag=tag,
                    changes=['CMD ["/bin/bash"]', f"ENV PATH={_PATH}", f"LABEL {LABEL_INPUTS}={rootfs_key}"])
            except Exception as exc:  # docker.errors.APIError
                raise ImageBuildError(f"docker import of {tarball} failed: {exc}") from exc
            done()
        node = host_node()
        old = self._image(BASE_IMAGE)
        done = _timed(self.say, f"[images] building {BASE_IMAGE} (+ {node} as /usr/local/bin/node)")
        image_id = self._build(BASE_IMAGE, _BASE_DOCKERFILE, [(node.parent, node.name)], {LABEL_INPUTS: digest},
                               renames=[(node.name, "node")] if node.name != "node" else [])
        done()
        self._drop_replaced(old, image_id)
        return BuildResult(BASE_IMAGE, "built", time.monotonic() - started, image_id)

    def build_harnesses(self, force: bool = False) -> BuildResult:
        started = time.monotonic()
        cache = harness_cache()
        for name in sorted(HARNESSES):  # installs any pinned CLI not yet in the cache (npm)
            try:
                ensure_harness(name, progress=self.say)
            except HarnessInstallError as exc:
                raise ImageBuildError(f"the pinned {name} CLI is not installed and could not be: {exc}") from exc
        digest = self.harness_digest()
        cached = self._cached(HARNESS_IMAGE, digest, force)
        if cached is not None:
            self.say(f"[images] {HARNESS_IMAGE}: up to date")
            return BuildResult(HARNESS_IMAGE, "cached", time.monotonic() - started, str(cached.id))
        prefixes = [f"{h.name}-{h.version}" for h in sorted(HARNESSES.values(), key=lambda h: h.name)]
        old = self._image(HARNESS_IMAGE)
        done = _timed(self.say, f"[images] building {HARNESS_IMAGE} ({', '.join(prefixes)} into {cache})")
        image_id = self._build(HARNESS_IMAGE, self._harness_dockerfile(), [(cache, p) for p in prefixes],
                               {LABEL_INPUTS: digest, LABEL_HARNESS_CACHE: str(cache),
                                LABEL_HARNESS_PINS: self.harness_pins()})
        done()
        self._drop_replaced(old, image_id)
        return BuildResult(HARNESS_IMAGE, "built", time.monotonic() - started, image_id)

    def build_swe(self, swe: SweImage, force: bool = False) -> BuildResult:
        started = time.monotonic()
        if not swe.source.is_dir():
            raise ImageBuildError(f"instance {swe.instance_id}: its repository {swe.source} is missing")
        digest = self.swe_digest(swe)
        cached = self._cached(swe.image, digest, force)
        if cached is not None:
            self.say(f"[images] {swe.image}: up to date")
            return BuildResult(swe.image, "cached", time.monotonic() - started, str(cached.id))
        with tempfile.TemporaryDirectory(prefix="rollwire-swe-") as scratch:
            commit = commit_repository(swe.source, Path(scratch, "testbed"))
            if commit != swe.base_commit:
                raise ImageBuildError(
                    f"instance {swe.instance_id}: {swe.source} commits as {commit}, not its base_commit "
                    f"{swe.base_commit}; the repository's files changed since the instance was written "
                    "(restore them, or update base_commit to the new hash)")
            old = self._image(swe.image)
            done = _timed(self.say, f"[images] building {swe.image} ({swe.instance_id} at {commit[:12]} in {TESTBED})")
            image_id = self._build(swe.image, _SWE_DOCKERFILE, [(Path(scratch), "testbed")],
                                   {LABEL_INPUTS: digest, LABEL_INSTANCE: swe.instance_id,
                                    LABEL_BASE_COMMIT: commit})
            done()
        self._drop_replaced(old, image_id)
        return BuildResult(swe.image, "built", time.monotonic() - started, image_id)

    def build(self, instances_file: Path | None = None, force: bool = False) -> list[BuildResult]:
        """Base, harnesses and one image per instance of ``instances_file`` (None: none), in that order."""
        swes = swe_images(instances_file) if instances_file is not None else []
        with self._lock():
            results = [self.build_base(force), self.build_harnesses(force)]
            results += [self.build_swe(swe, force) for swe in swes]
            self.prune_replaced()
        return results

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """One build at a time per cache (a second waits, then finds the first's images up to date)."""
        path = self.cache / "images" / "build.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path):
            yield

    def expected(self, instances_file: Path | None) -> dict[str, str]:
        """Image name -> the digest a build would give it now (what ``list`` compares with)."""
        expected: dict[str, str] = {}
        try:
            expected[BASE_IMAGE] = self.base_digest()
            expected[ROOTFS_IMAGE] = self.rootfs_key()
            expected[HARNESS_IMAGE] = self.harness_digest()
            for swe in swe_images(instances_file) if instances_file is not None else []:
                if swe.source.is_dir():
                    expected[swe.image] = self.swe_digest(swe)
        except (DeployError, OSError):
            pass
        return expected

    def rows(self, instances_file: Path | None = None) -> list[ImageRow]:
        """The engine's rollwire images (``rollwire/*``), each with its size and whether it is up to date."""
        expected = self.expected(instances_file)
        rows = []
        for image in self.client.images.list(name="rollwire/*"):
            for tag in image.tags or [image.short_id]:
                want = expected.get(tag)
                rows.append(ImageRow(tag, image.short_id.removeprefix("sha256:"), int(image.attrs.get("Size", 0)),
                                     str(image.attrs.get("Created", ""))[:19],
                                     None if want is None else (image.labels or {}).get(LABEL_INPUTS) == want))
        return sorted(rows, key=lambda r: r.image)


def build_images(instances_file: Path | None = None, force: bool = False, say: Say = print) -> list[BuildResult]:
    """``rollwire images build``: every image, each only when its inputs changed (``force``: all)."""
    started = time.monotonic()
    results = ImageBuilder(say=say).build(instances_file, force)
    built = sum(r.status == "built" for r in results)
    say(f"[images] {built} built, {len(results) - built} up to date, in {time.monotonic() - started:.1f} s")
    return results


def list_images(instances_file: Path | None = None) -> list[ImageRow]:
    return ImageBuilder(say=lambda _: None).rows(instances_file)
