"""`rollwire proxy` (run the gateway proxy) and `rollwire session new|end` (ad-hoc sessions by hand).

`session new` builds its request body from its options and validates it with the same pydantic model the
proxy uses (:class:`schemas.api.SessionCreate`) before sending anything: a bad value is a usage error
(exit 2) and the proxy is never called. A proxy that cannot be reached, or that refuses the request, is a
failure (exit 1) reported with the status and the proxy's own message.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, NoReturn

import httpx
import typer
from pydantic import ValidationError

from proxy.server import proxy_server
from proxy.settings import ProxySettings
from schemas.admin_token import admin_token
from schemas.api import SessionCreate, SessionEnd
from schemas.tasks import EngineParams
from schemas.ui_links import session_url

session_app = typer.Typer(help="Ad-hoc sessions on a running proxy.", no_args_is_help=True)

USAGE_ERROR = 2  # a bad option value: nothing was sent
FAILED = 1  # the proxy could not be reached or refused the request
HTTP_TIMEOUT_S = 30.0


def run(host: str = typer.Option(None, help="Listen address (ROLLWIRE_PROXY_HOST)."),
        port: int = typer.Option(None, help="Listen port (ROLLWIRE_PROXY_PORT)."),
        engine_url: str = typer.Option(None, help="vLLM OpenAI server (ROLLWIRE_ENGINE_URL).")) -> None:
    """Serve the proxy in the foreground."""
    from proxy.app import create_app

    given = {"proxy_host": host, "proxy_port": port, "engine_url": engine_url}
    overrides: dict[str, Any] = {name: value for name, value in given.items() if value}
    settings = ProxySettings(**overrides)
    app = create_app(settings)
    # Everything imported so far (modules, pydantic's schemas: about 120k objects) lives as long as the
    # process: out of the cyclic collector's way, its full collections stop walking it on every pass
    # (pauses of tens of milliseconds under load otherwise).
    gc.collect()
    gc.freeze()
    # A call's garbage is freed by reference counting as it goes; the cyclic collector only needs to run
    # now and then. At the default 700 allocations it ran every few hundred microseconds under load, and
    # each pass moved the requests in flight (a parsed 40 KB body is thousands of objects) a generation
    # up, until a full collection walked them all.
    gc.set_threshold(*_GC_THRESHOLDS)
    proxy_server(app, settings.proxy_host, settings.proxy_port, settings.proxy_shutdown_grace_s).run()


_GC_THRESHOLDS = (50_000, 20, 10)


# -- helpers ---------------------------------------------------------------------------------------------

def _fail(message: str, code: int) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=code)


def _json_option(option: str, value: str | None) -> Any:
    """The JSON value of ``option``: inline JSON, or ``@path`` for a file holding it (None if not given)."""
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            _fail(f"{option}: cannot read {str(path)!r}: {exc.strerror or exc}", USAGE_ERROR)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        source = f"file {value[1:]!r}" if value.startswith("@") else "value"
        _fail(f"{option}: {source} is not valid JSON ({exc})", USAGE_ERROR)


_ENGINE_FIELDS: frozenset[str] = frozenset(EngineParams.model_fields)


def _option_name(loc: tuple[int | str, ...]) -> str:
    """The CLI option a validation error location belongs to, e.g. ('engine', 'max_tokens') -> --max-tokens."""
    parts = [str(p) for p in loc]
    if len(parts) >= 2 and parts[0] == "engine" and parts[1] in _ENGINE_FIELDS:
        head, rest = parts[1], parts[2:]
    elif parts:
        head, rest = parts[0], parts[1:]
    else:
        return "request"
    name = "--" + head.replace("_", "-")
    return f"{name} ({'.'.join(rest)})" if rest else name


def _validation_message(exc: ValidationError) -> str:
    lines = [f"{_option_name(tuple(e['loc']))}: {e['msg']}" for e in exc.errors()]
    return "invalid session options:\n  " + "\n  ".join(lines)


def _proxy_message(response: httpx.Response) -> str:
    """The proxy's own words from an error response: its ``detail`` or OpenAI-style ``error.message``."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        if isinstance(body.get("detail"), str):
            return body["detail"]
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
    return json.dumps(body)


def _post(url: str, body: dict[str, Any], expected: int, key: str | None = None) -> dict[str, Any]:
    """POST ``body`` to the proxy and return its JSON answer; exit 1 on no answer or a refusal. The request
    carries ``key`` (a session's key), else the proxy's admin token when one is set here."""
    token = key or admin_token()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the proxy at {url}: {exc or type(exc).__name__}", FAILED)
    if response.status_code != expected:
        _fail(f"the proxy refused the request: {response.status_code} {_proxy_message(response)}", FAILED)
    try:
        answer: dict[str, Any] = response.json()
    except ValueError:
        _fail(f"the proxy answered {response.status_code} with a body that is not JSON: {response.text[:200]}",
              FAILED)
    return answer


def _base_url(proxy_url: str | None) -> str:
    return (proxy_url or ProxySettings().public_url).rstrip("/")


# -- session commands ------------------------------------------------------------------------------------

@session_app.command("new")
def new_session(
        session_id: str = typer.Option(None, help="Id to use (default: generated)."),
        proxy_url: str = typer.Option(None, help="Proxy base URL (default from settings)."),
        max_tokens: int = typer.Option(None, help="Cap on output tokens per call (overrides the harness)."),
        temperature: float = typer.Option(None, help="Sampling temperature (>= 0; 0 is greedy)."),
        top_p: float = typer.Option(None, help="Nucleus sampling, in (0, 1]."),
        top_k: int = typer.Option(None, help="Top-k sampling (-1 or unset: off)."),
        seed: int = typer.Option(None, help="Sampling seed."),
        extra: str = typer.Option(None, help="Engine extras: a JSON object, or @file.json."),
        turns: str = typer.Option(None, help=(
            "Per-turn engine extras merged over --extra: a JSON list of objects, or @file.json (entry N for "
            "the call after N assistant turns, the last entry for every later one).")),
        task_id: str = typer.Option(None, help="Task id to record the session under."),
        agent: str = typer.Option(None, help=(
            "The agent spec: a JSON object ({\"harness\": ..., \"model\": ...}), @file.json, or a bare "
            "harness name.")),
        builder: str = typer.Option(None, help="Trajectory builder: prefix_merging (default) or per_request."),
        policy_version: str = typer.Option(None, help="Policy version the recorded data belongs to."),
        timeout_s: float = typer.Option(None, help="Seconds until the session times out (default 86400)."),
        api_key: str = typer.Option(None, help="Session API key to use (default: generated; 8+ characters)."),
        metadata: str = typer.Option(None, help="Free-form metadata: a JSON object, or @file.json."),
) -> None:
    """Register an ad-hoc session and print its id, key and base URLs as JSON."""
    engine: dict[str, Any] = {name: value for name, value in {
        "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
        "extra": _json_option("--extra", extra), "turns": _json_option("--turns", turns)}.items()
        if value is not None}
    agent_value: Any = None
    if agent is not None:
        agent_value = _json_option("--agent", agent) if agent.lstrip().startswith(("{", "@")) else {"harness": agent}
    body: dict[str, Any] = {name: value for name, value in {
        "session_id": session_id, "api_key": api_key, "task_id": task_id, "agent": agent_value,
        "builder": builder, "policy_version": policy_version, "timeout_s": timeout_s,
        "metadata": _json_option("--metadata", metadata)}.items() if value is not None}
    if engine:
        body["engine"] = engine
    try:
        request = SessionCreate.model_validate(body)
    except ValidationError as exc:
        _fail(_validation_message(exc), USAGE_ERROR)
    answer = _post(f"{_base_url(proxy_url)}/v1/sessions", request.model_dump(mode="json", exclude_unset=True),
                   expected=201)
    # Where to look at the session as it goes (the web page, ROLLWIRE_UI_URL; `rollwire ui` serves it).
    answer["page"] = session_url(answer["session_id"])
    typer.echo(json.dumps(answer, indent=2))


@session_app.command("end")
def end_session(session_id: str = typer.Argument(..., help="The session to end."),
                status: str = typer.Option("completed", help="completed, timeout, error or cancelled."),
                api_key: str = typer.Option(None, help=(
                    "The session's API key (as `session new` printed it); without it, the proxy's admin "
                    "token (ROLLWIRE_PROXY_ADMIN_TOKEN, else the one `rollwire up` keeps) is sent.")),
                proxy_url: str = typer.Option(None, help="Proxy base URL (default from settings).")) -> None:
    """End a session: its key stops working and the processors build its trajectories."""
    try:
        request = SessionEnd.model_validate({"status": status})
    except ValidationError as exc:
        _fail(f"--status: {exc.errors()[0]['msg']}", USAGE_ERROR)
    answer = _post(f"{_base_url(proxy_url)}/v1/sessions/{session_id}/end",
                   request.model_dump(mode="json", exclude_unset=True), expected=200, key=api_key)
    typer.echo(json.dumps(answer, indent=2))
