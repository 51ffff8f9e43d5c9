"""`rollwire schemas …`: export the event contract as JSON Schema and show the topic registry."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from schemas.export import export_json_schemas, topics_document
from schemas.transport.settings import KafkaSettings

app = typer.Typer(help="The event contract: JSON Schemas and topics.", no_args_is_help=True)


@app.command("export")
def export(directory: Path = typer.Argument(..., help="Folder to write the .schema.json files into.")) -> None:
    """Write JSON Schema for every event and API model, and topics.json."""
    paths = export_json_schemas(directory, KafkaSettings().registry())
    for path in paths:
        typer.echo(str(path))


@app.command("topics")
def topics() -> None:
    """Print the topic registry (names, keys, partitions, configs) as JSON."""
    typer.echo(json.dumps(topics_document(KafkaSettings().registry()), indent=2))
