"""HAProxy in front of the proxy tier: the configuration it runs with, and running it in the foreground.

With ``rollwire up --proxies N`` (and the main job's ``--proxies N``), N proxy processes (``proxy-0`` ...)
listen on ports of their own and one HAProxy (Debian's ``haproxy``, 2.6 or newer) listens
on the proxy's usual address, so the URL harnesses and gateway nodes use does not change. This module owns
that HAProxy and nothing else: the configuration text (:func:`haproxy_config`), where it is written
(``$ROLLWIRE_HOME/proxy-front/haproxy.cfg``) and ``rollwire proxy-front``, which writes it from the
environment and runs HAProxy in the foreground, so the stack starts, watches and stops it as it does every
other service (deploy/services.py). Bringing the processes up is deploy/stack.py's.

The rules, and why:

- **A session's calls go to one process, and sessions spread by load.** The key is the session id of a
  ``/s/{session_id}/...`` path, else the key the harness sends (``Authorization: Bearer``, ``x-api-key``,
  ``x-goog-api-key``, then ``?key=``). A session's first call goes to the process with the fewest calls in
  flight (``balance leastconn``) and the front remembers where (a stick table, a day per session); its later
  calls go there. A hash of the key would need no table, but with the few sessions a tier serves at once it
  spreads them by chance, and one process can carry most of the load. A process keeps per-session state that
  its calls warm (a branch's exact token ids, call numbers, the digests that tell an SDK's retry), but every
  process reads every session from the ``sessions`` topic and that state is a view of the log: affinity is an
  optimisation, never needed for a call to be served and recorded (docs/design.md, "The fleet"), so a front
  started again (its table empty) or a session sent elsewhere costs a read of the session's log, never a
  wrong call.
- **A dead process leaves at once.** Each process's ``/health`` is read every second (every 250 ms while its
  state changes), two failures take it out, and a refused connection takes it out on the spot (``observe
  layer4``): its sessions go to the other processes (each to the least busy, and stay there).
- **Only a request that never reached a process is sent again** (``retry-on conn-failure``, to another
  process: ``option redispatch 1``). A request a process received may be at the engine or on Kafka already;
  sending it again could record one call twice, so a call cut after it arrived fails to the harness, whose
  SDK decides.
- **Streams pass as they come.** No request buffering, no compression, and ``option http-no-delay``: without
  it HAProxy sends an unfinished body's small chunks with ``MSG_MORE`` and the kernel holds them back, so a
  stream of one token every 40 ms reached the harness in bursts some 200 ms apart
  (tests/deploy/test_proxy_front.py measures the pacing). The server timeout is a backstop behind the
  proxy's own (:func:`server_timeout_s`), so the proxy always answers first.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

import typer

from deploy.errors import DeployError
from deploy.settings import ProxyTierSettings, load
from proxy.settings import ProxySettings
from schemas import paths

FRONT_NAME = "proxy-front"
"""The front's service name: its folder, pid file and log under ``$ROLLWIRE_HOME``."""
BACKEND = "proxies"
"""The HAProxy backend holding the proxy processes (its name on the stats page)."""
HEALTH_PATH = "/health"
"""The front's own health (on the stats port): 200 while at least one proxy process is up."""
STATS_PATH = "/stats"
SERVED_BY_HEADER = "x-rollwire-proxy"
"""The response header naming the process that served a request (``proxy-<i>``)."""
TIMEOUT_MARGIN_S = 60.0
INSTALL_HINT = "apt-get update && apt-get install -y haproxy"


class FrontError(DeployError):
    """HAProxy is missing, or the front's configuration cannot be made."""


@dataclass(frozen=True)
class Backend:
    """One proxy process behind the front."""

    name: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class FrontConfig:
    """What the front's configuration says: where it listens, its processes and its server timeout."""

    host: str
    port: int
    stats_port: int
    backends: tuple[Backend, ...]
    server_timeout_s: float

    def __post_init__(self) -> None:
        if not self.backends:
            raise FrontError("the proxy front needs at least one proxy process (ROLLWIRE_PROXY_BACKENDS)")
        if len({b.name for b in self.backends}) != len(self.backends):
            raise FrontError("ROLLWIRE_PROXY_BACKENDS names a process twice")


def member_name(index: int) -> str:
    """The ``index``-th proxy process's name: its ``ROLLWIRE_PROXY_INSTANCE``, service name and server name."""
    return f"proxy-{index}"


def default_backends(host: str, first_port: int, count: int) -> tuple[Backend, ...]:
    """``count`` processes on ``host`` from ``first_port`` on, named ``proxy-0`` ..."""
    return tuple(Backend(member_name(i), host, first_port + i) for i in range(count))


def backends_spec(backends: tuple[Backend, ...] | list[Backend]) -> str:
    """``backends`` as ``ROLLWIRE_PROXY_BACKENDS`` writes them: ``NAME=URL``, comma-separated."""
    return ",".join(f"{b.name}={b.url}" for b in backends)


def parse_backends(text: str) -> tuple[Backend, ...]:
    """``NAME=URL`` entries, comma-separated (``ROLLWIRE_PROXY_BACKENDS``); a malformed one fails naming it."""
    found = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, url = item.partition("=")
        where = urlsplit(url.strip())
        try:
            port = where.port
        except ValueError:
            port = None
        if not name.strip() or where.scheme != "http" or not where.hostname or port is None:
            raise FrontError(f"ROLLWIRE_PROXY_BACKENDS: {item!r} is not NAME=http://host:port")
        found.append(Backend(name.strip(), where.hostname, port))
    return tuple(found)


def server_timeout_s(proxy: ProxySettings) -> float:
    """How long the front waits on a process that sends nothing: the longest a process may keep a request
    before answering (a call held for its session's policy version, then the engine's reply; or one step of a
    weight update), and a margin, so that the proxy's own timeouts always answer first."""
    return max(proxy.policy_floor_wait_s + proxy.engine_timeout_s, proxy.weight_update_timeout_s) + TIMEOUT_MARGIN_S


def front_config(proxy: ProxySettings, tier: ProxyTierSettings) -> FrontConfig:
    """The front as the environment describes it: on the proxy's address, over ``ROLLWIRE_PROXY_BACKENDS``
    (default: ``ROLLWIRE_PROXY_COUNT`` processes from ``ROLLWIRE_PROXY_TIER_PORT``)."""
    backends = (parse_backends(tier.backends) if tier.backends
                else default_backends(proxy.proxy_host, tier.tier_port, tier.count))
    return FrontConfig(host=proxy.proxy_host, port=proxy.proxy_port, stats_port=tier.stats_port,
                       backends=backends, server_timeout_s=server_timeout_s(proxy))


# The session's key, first found wins: a session addressed by path, then the key headers in the order the
# provider SDKs send them, then Gemini's ?key=. `req.fhdr` reads a header's whole value (no comma splitting).
_AFFINITY_RULES = """\
    http-request set-var(txn.rw_affinity) path,field(3,/) if { path_reg ^/s/[^/]+ }
    http-request set-var(txn.rw_affinity) req.fhdr(authorization),regsub("^[Bb]earer +","") if !{ var(txn.rw_affinity) -m found } { req.fhdr(authorization) -m found }
    http-request set-var(txn.rw_affinity) req.fhdr(x-api-key) if !{ var(txn.rw_affinity) -m found }
    http-request set-var(txn.rw_affinity) req.fhdr(x-goog-api-key) if !{ var(txn.rw_affinity) -m found }
    http-request set-var(txn.rw_affinity) url_param(key) if !{ var(txn.rw_affinity) -m found }
    balance leastconn
    stick-table type string len 160 size 1m expire 24h
    stick on var(txn.rw_affinity)"""


def haproxy_config(front: FrontConfig) -> str:
    """The HAProxy configuration of ``front`` (the rules are the module's docstring's)."""
    timeout = f"{int(front.server_timeout_s)}s"
    servers = "\n".join(f"    server {b.name} {b.host}:{b.port}" for b in front.backends)
    return f"""\
# The proxy tier's front, written by rollwire (deploy/proxy_front.py) each time it starts: edits are lost.
global
    log stderr format raw local0 info
    maxconn 4096

defaults
    mode http
    log global
    option httplog
    option dontlognull
    timeout connect 2s
    timeout client {timeout}
    timeout server {timeout}
    timeout http-request 60s
    timeout http-keep-alive 60s
    timeout queue 30s
    timeout check 2s

frontend proxy
    bind {front.host}:{front.port}
    default_backend {BACKEND}

backend {BACKEND}
{_AFFINITY_RULES}
    option http-no-delay
    option httpchk GET /health
    http-check expect status 200
    retries 2
    retry-on conn-failure
    option redispatch 1
    http-response set-header {SERVED_BY_HEADER} %[srv_name]
    default-server check inter 1s fastinter 250ms downinter 1s fall 2 rise 2 observe layer4 error-limit 1 on-error mark-down
{servers}

listen stats
    bind {front.host}:{front.stats_port}
    monitor-uri {HEALTH_PATH}
    monitor fail if {{ nbsrv({BACKEND}) lt 1 }}
    stats enable
    stats uri {STATS_PATH}
    stats refresh 5s
"""


def config_path(home: Path | None = None) -> Path:
    return (home or paths.home()) / FRONT_NAME / "haproxy.cfg"


def write_config(front: FrontConfig, home: Path | None = None) -> Path:
    """Write ``front``'s configuration where the front runs it from; returns the file."""
    path = config_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(haproxy_config(front), encoding="utf-8")
    return path


def haproxy_binary() -> str:
    """The installed ``haproxy``, or a FrontError saying how to install it."""
    found = shutil.which("haproxy")
    if found is None:
        raise FrontError(f"several proxy processes need HAProxy in front of them and it is not installed: "
                         f"{INSTALL_HINT}")
    return found


def run_front() -> None:
    """Run HAProxy in front of the proxy tier, in the foreground (the tier's processes are started apart)."""
    try:
        front = front_config(ProxySettings(), load(ProxyTierSettings))
        binary = haproxy_binary()
    except DeployError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None
    path = write_config(front)
    typer.echo(f"proxy front on http://{front.host}:{front.port} over "
               f"{', '.join(f'{b.name} ({b.url})' for b in front.backends)}; stats on "
               f"http://{front.host}:{front.stats_port}{STATS_PATH}; configuration {path}", err=True)
    # A child, not exec: the service's pid file recognises this command line (deploy/services.py), and a stop
    # signals the whole process group, HAProxy with it.
    process = subprocess.Popen([binary, "-db", "-f", str(path)])

    def forward(signum: int, frame: FrameType | None) -> None:
        process.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    raise typer.Exit(code=process.wait())
