"""Reference proxies for ``bench.proxy_overhead --peers``: a bare nginx reverse proxy and LiteLLM's proxy.

Each peer is put in front of the same stand-in engine as rollwire and started by the bench as a child
process with its own configuration in a temporary folder. A peer that cannot be started (not installed,
failed to come up) is reported as :class:`PeerMissing` with the reason; the bench skips it and says so,
it never fakes a figure.

- **nginx**: Debian's package (``apt-get install -y nginx``), one worker, not daemonized, its own prefix,
  ``proxy_buffering off`` (each SSE chunk goes out as it comes), HTTP/1.1 keep-alive to the upstream,
  request bodies kept in memory, no access log: the floor a hop can cost.
- **LiteLLM**: its proxy from PyPI, pinned to :data:`LITELLM_VERSION`, in an environment of its own
  (``ROLLWIRE_LITELLM_VENV``, default ``~/.cache/rollwire/litellm-venv``; ``python -m bench.peers
  install-litellm`` makes it), one worker, no database, no logging callbacks, the local model cost map.
  1.106 refuses to start without ``LITELLM_MASTER_KEY``, so the bench sets one and sends it as the key.

    python -m bench.peers install-litellm
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# 1.106.10 needs a certifi newer than the package index here has; 1.107.0 was a compromised release.
LITELLM_VERSION = "1.106.0"
LITELLM_MASTER_KEY = "sk-rollwire-bench"


class PeerMissing(Exception):
    """A reference proxy that cannot be run here; the message says why."""


@dataclass
class Peer:
    """A running reference proxy: where to send chat completions, with which headers."""

    name: str
    chat_url: str
    headers: dict[str, str]
    process: subprocess.Popen[bytes]
    workdir: Path
    version: str
    _log: Path = field(default=Path("/dev/null"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_up(process: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PeerMissing(f"exited with {process.returncode}: {log.read_text(errors='replace')[-600:]!r}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    process.terminate()
    raise PeerMissing(f"did not answer {url} within {timeout_s:.0f} s: {log.read_text(errors='replace')[-600:]!r}")


_NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 4m;
    upstream engine {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def start_nginx(upstream_port: int, log_dir: str) -> Peer:
    """nginx in front of ``127.0.0.1:upstream_port``; raises PeerMissing when it is not installed."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        raise PeerMissing("nginx is not installed (Debian: apt-get update && apt-get install -y nginx)")
    version = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip().rpartition("/")[2]
    workdir = Path(tempfile.mkdtemp(prefix="rollwire-nginx-"))
    workdir.chmod(0o755)  # nginx's workers drop root and still need the temp paths
    port = _free_port()
    (workdir / "nginx.conf").write_text(_NGINX_CONF.format(dir=workdir, port=port, upstream_port=upstream_port))
    log = Path(log_dir + "nginx.log")
    with open(log, "wb") as out:
        process = subprocess.Popen([binary, "-p", str(workdir), "-c", str(workdir / "nginx.conf"),
                                    "-e", str(workdir / "error.log")], stdout=out, stderr=subprocess.STDOUT)
    peer = Peer("nginx", f"http://127.0.0.1:{port}/v1/chat/completions", {"content-type": "application/json"},
                process, workdir, version, log)
    try:
        _wait_up(process, f"http://127.0.0.1:{port}/health", log, 20)
    except PeerMissing:
        peer.stop()
        raise
    return peer


def litellm_venv() -> Path:
    return Path(os.environ.get("ROLLWIRE_LITELLM_VENV", Path.home() / ".cache/rollwire/litellm-venv"))


_LITELLM_CONF = """\
model_list:
  - model_name: "*"
    litellm_params:
      model: "openai/{model}"
      api_base: "http://127.0.0.1:{upstream_port}/v1"
      api_key: "none"
litellm_settings:
  drop_params: true
  turn_off_message_logging: true
  callbacks: []
  success_callback: []
  failure_callback: []
general_settings:
  disable_spend_logs: true
  disable_error_logs: true
"""


def start_litellm(upstream_port: int, model: str, log_dir: str) -> Peer:
    """LiteLLM's proxy in front of the stand-in; raises PeerMissing when its environment is not there."""
    venv = litellm_venv()
    binary = venv / "bin" / "litellm"
    if not binary.exists():
        raise PeerMissing(f"LiteLLM is not installed in {venv} (python -m bench.peers install-litellm)")
    version = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('litellm'))"],
                             capture_output=True, text=True).stdout.strip()
    workdir = Path(tempfile.mkdtemp(prefix="rollwire-litellm-"))
    port = _free_port()
    (workdir / "config.yaml").write_text(_LITELLM_CONF.format(model=model, upstream_port=upstream_port))
    log = Path(log_dir + "litellm.log")
    env = {**os.environ, "LITELLM_MASTER_KEY": LITELLM_MASTER_KEY, "LITELLM_LOG": "ERROR",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "DISABLE_ADMIN_UI": "True"}
    env.pop("DATABASE_URL", None)
    with open(log, "wb") as out:
        process = subprocess.Popen([str(binary), "--config", str(workdir / "config.yaml"), "--host", "127.0.0.1",
                                    "--port", str(port), "--num_workers", "1"],
                                   cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    peer = Peer("litellm", f"http://127.0.0.1:{port}/v1/chat/completions",
                {"content-type": "application/json", "authorization": f"Bearer {LITELLM_MASTER_KEY}"},
                process, workdir, version, log)
    try:
        _wait_up(process, f"http://127.0.0.1:{port}/health/liveliness", log, 180)
    except PeerMissing:
        peer.stop()
        raise
    return peer


def install_litellm() -> None:
    """Make LiteLLM's own environment (its dependencies would clash with rollwire's)."""
    venv = litellm_venv()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", f"litellm[proxy]=={LITELLM_VERSION}"], check=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["install-litellm"]:
        sys.exit("usage: python -m bench.peers install-litellm")
    install_litellm()
