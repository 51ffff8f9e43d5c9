"""`rollwire proxy` (run the gateway proxy) and `rollwire session new|end` (ad-hoc sessions by hand)."""

from __future__ import annotations

import json

import httpx
import typer
import uvicorn

from proxy.settings import ProxySettings

app = typer.Typer(help="The gateway proxy.", no_args_is_help=True)
session_app = typer.Typer(help="Ad-hoc sessions on a running proxy.", no_args_is_help=True)


@app.command("run")
def run(host: str = typer.Option(None, help="Listen address (ROLLWIRE_PROXY_HOST)."),
        port: int = typer.Option(None, help="Listen port (ROLLWIRE_PROXY_PORT)."),
        engine_url: str = typer.Option(None, help="vLLM OpenAI server (ROLLWIRE_ENGINE_URL).")) -> None:
    """Serve the proxy in the foreground."""
    from proxy.app import create_app

    overrides = {k: v for k, v in {"proxy_host": host, "proxy_port": port, "engine_url": engine_url}.items() if v}
    settings = ProxySettings(**overrides)
    uvicorn.run(create_app(settings), host=settings.proxy_host, port=settings.proxy_port, log_level="warning",
                access_log=False)


@session_app.command("new")
def new_session(session_id: str = typer.Option(None, help="Id to use (default: generated)."),
                proxy_url: str = typer.Option(None, help="Proxy base URL (default from settings).")) -> None:
    """Register an ad-hoc session and print its id, key and base URLs as JSON."""
    url = proxy_url or ProxySettings().public_url
    body = {"session_id": session_id} if session_id else {}
    response = httpx.post(f"{url}/v1/sessions", json=body, timeout=30)
    if response.status_code != 201:
        typer.secho(f"error: {response.status_code} {response.text}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)
    typer.echo(json.dumps(response.json(), indent=2))


@session_app.command("end")
def end_session(session_id: str = typer.Argument(..., help="The session to end."),
                status: str = typer.Option("completed", help="completed, timeout, error or cancelled."),
                proxy_url: str = typer.Option(None, help="Proxy base URL (default from settings).")) -> None:
    """End a session: its key stops working and the processors build its trajectories."""
    url = proxy_url or ProxySettings().public_url
    response = httpx.post(f"{url}/v1/sessions/{session_id}/end", json={"status": status}, timeout=30)
    if response.status_code != 200:
        typer.secho(f"error: {response.status_code} {response.text}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)
    typer.echo(json.dumps(response.json(), indent=2))
