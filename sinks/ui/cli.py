"""``rollwire ui``: serve the read-only web page over the topics in the foreground.

Reads ``ROLLWIRE_KAFKA_BOOTSTRAP`` / ``ROLLWIRE_TOPIC_PREFIX`` like every service, and ``UiSettings``
(``ROLLWIRE_UI_*``); options override the variables.
"""

from __future__ import annotations

import typer
import uvicorn

from schemas.ui_links import DEFAULT_UI_PORT
from sinks.ui.settings import UiSettings


def run_ui(host: str = typer.Option(None, help="Listen address (ROLLWIRE_UI_HOST, default 127.0.0.1)."),
           port: int = typer.Option(None, help=f"Listen port (ROLLWIRE_UI_PORT, default {DEFAULT_UI_PORT})."),
           max_bytes: int = typer.Option(None, help="The view's memory budget in bytes (ROLLWIRE_UI_MAX_BYTES): "
                                         "sessions updated least recently are dropped past it."),
           tokenizer: str = typer.Option(None, help="tokenizer.json, or the model folder holding it, for the "
                                         "trace page (ROLLWIRE_UI_TOKENIZER; default: the Qwen vocabulary).")) -> None:
    """Serve the read-only web page (runs, sessions, traces) built from the topics."""
    from schemas.transport.settings import KafkaSettings
    from sinks.ui.app import create_app
    from sinks.ui.tokens import decoder_for
    from sinks.ui.view import RunView

    try:
        settings = UiSettings()
        view = RunView(max_bytes=max_bytes or settings.max_bytes)
        decoder = decoder_for(tokenizer or settings.tokenizer)
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from exc
    listen_host = host or settings.host
    listen_port = port or settings.port
    typer.echo(f"ui=http://{listen_host}:{listen_port}/")
    uvicorn.run(create_app(view, decoder, KafkaSettings()), host=listen_host, port=listen_port,
                log_level="warning", access_log=False)
