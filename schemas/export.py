"""JSON Schema export: one file per event and API model plus the topic registry, for other languages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from schemas.codec import EVENT_MODELS, any_event_adapter
from schemas.tasks import TaskRequest
from schemas.topics import TopicRegistry

API_MODELS: tuple[type[BaseModel], ...] = (TaskRequest,)


def _write(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def topics_document(registry: TopicRegistry) -> dict[str, Any]:
    return {
        "topics": [
            {
                "name": spec.name,
                "key": spec.key.value,
                "partitions": spec.partitions,
                "configs": spec.configs(),
                "event_types": sorted(spec.event_types),
            }
            for spec in registry.specs()
        ]
    }


def export_json_schemas(directory: Path, registry: TopicRegistry | None = None) -> list[Path]:
    """Write ``<event_type>.schema.json`` per event, ``event.schema.json`` (the union), each API model's
    schema, and ``topics.json``; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for model in EVENT_MODELS:
        event_type = model.model_fields["event_type"].default
        schema = model.model_json_schema(mode="serialization")
        schema["$comment"] = f"rollwire event '{event_type}' on topic '{model.topic.value}', keyed by {model.key_field}"
        written.append(_write(directory / f"{event_type}.schema.json", schema))
    written.append(_write(directory / "event.schema.json", any_event_adapter.json_schema(mode="serialization")))
    for api_model in API_MODELS:
        written.append(_write(directory / f"{api_model.__name__}.schema.json", api_model.model_json_schema()))
    written.append(_write(directory / "topics.json", topics_document(registry or TopicRegistry())))
    return written
