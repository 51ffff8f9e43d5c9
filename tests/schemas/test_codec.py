"""Event encoding: every type round-trips; each kind of bad record fails with its own error type."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas.codec import EVENT_TYPES, EventDecodeError, decode_event, encode_event, encode_record, event_headers
from schemas.completions import Completion
from schemas.export import export_json_schemas
from schemas.topics import Topic, TopicRegistry
from tests.samples import completion, every_event


def test_samples_cover_every_event_type() -> None:
    assert {e.event_type for e in every_event()} == set(EVENT_TYPES)


@pytest.mark.parametrize("event", every_event(), ids=lambda e: e.event_type)
def test_every_event_round_trips(event) -> None:
    decoded = decode_event(encode_event(event), TopicRegistry().spec(event.topic))
    assert type(decoded) is type(event)
    assert decoded == event


def test_arrays_are_not_json_number_lists() -> None:
    document = json.loads(encode_event(completion(prompt_len=500)))
    assert isinstance(document["prompt_token_ids"], str) and document["prompt_token_ids"].startswith("i4:")
    assert isinstance(document["logprobs"], str) and document["logprobs"].startswith("f4:")


def test_headers_name_type_and_version() -> None:
    assert dict(event_headers(completion())) == {"rollwire-event-type": b"completion",
                                                 "rollwire-schema-version": b"2"}
    v1 = completion().model_copy(update={"schema_version": 1})
    assert dict(event_headers(v1))["rollwire-schema-version"] == b"1"


@pytest.mark.parametrize("event", every_event(), ids=lambda e: e.event_type)
def test_encode_record_stamps_keys_and_heads_each_event(event) -> None:
    record = encode_record(event, "writer@host:1")
    assert record.event.emitted_at is not None and record.event.source == (event.source or "writer@host:1")
    assert record.key == event.key() and record.headers == event_headers(record.event)
    decoded = decode_event(record.value, TopicRegistry().spec(event.topic))
    assert decoded == record.event and decoded.event_id == event.event_id


def test_encode_record_keeps_a_source_already_set() -> None:
    record = encode_record(completion().model_copy(update={"source": "proxy@a:1"}), "rebuild")
    assert record.event.source == "proxy@a:1"


@pytest.mark.parametrize("value, error_type", [
    (None, "empty_value"),
    (b"\xff\xfe not utf8", "invalid_json"),
    (b"{truncated", "invalid_json"),
    (b"[1, 2]", "invalid_event"),
    (b'{"event_type": "no.such", "schema_version": 1}', "unknown_event_type"),
    (b'{"event_type": "completion", "schema_version": 99}', "unsupported_schema_version"),
    (b'{"event_type": "completion", "schema_version": 1, "session_id": "s"}', "invalid_event"),
])
def test_bad_records_are_classified(value, error_type) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_event(value)
    assert info.value.error_type == error_type


def test_event_on_the_wrong_topic_is_refused() -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_event(encode_event(completion()), TopicRegistry().spec(Topic.GROUPS))
    assert info.value.error_type == "wrong_topic"


def test_unknown_fields_are_refused_in_our_own_events() -> None:
    document = json.loads(encode_event(completion()))
    document["sesion_id"] = "typo"
    with pytest.raises(EventDecodeError, match="sesion_id"):
        decode_event(json.dumps(document).encode())


def test_logprobs_must_match_sampled_tokens() -> None:
    with pytest.raises(ValidationError, match="one value per sampled token"):
        Completion.model_validate({**completion().model_dump(), "logprobs": [-1.0]})


def test_failed_completion_must_say_why() -> None:
    with pytest.raises(ValidationError, match="must say why"):
        Completion(session_id="s", sequence=0, api="openai.chat", status="error",
                   request={"messages": [{"role": "user", "content": "x"}]})


@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, 151_935), max_size=2000),
       sampled=st.lists(st.tuples(st.integers(0, 151_935), st.floats(-50, 0, width=32)), max_size=500))
def test_completion_round_trip_property(prompt, sampled) -> None:
    event = Completion(session_id="s", sequence=3, api="gemini",
                       request={"messages": [{"role": "user", "content": "x"}]},
                       prompt_token_ids=prompt, token_ids=[t for t, _ in sampled],
                       logprobs=[lp for _, lp in sampled])
    decoded = decode_event(encode_event(event))
    assert decoded.prompt_token_ids.tolist() == prompt
    assert decoded.token_ids.tolist() == [t for t, _ in sampled]
    assert decoded.logprobs.tolist() == [lp for _, lp in sampled]


def test_exported_json_schemas_accept_the_encoded_events(tmp_path) -> None:
    """A reader in another language validates our records with the exported schemas."""
    export_json_schemas(tmp_path)
    union = json.loads((tmp_path / "event.schema.json").read_text())
    for event in every_event():
        document = json.loads(encode_event(event))
        own = json.loads((tmp_path / f"{event.event_type}.schema.json").read_text())
        jsonschema.validate(document, own)
        jsonschema.validate(document, union)
    broken = json.loads(encode_event(completion()))
    broken["token_ids"] = [1, 2, 3]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, union)
    topics = json.loads((tmp_path / "topics.json").read_text())["topics"]
    assert {t["name"] for t in topics} == {f"rollwire.{t.value}" for t in Topic}


def test_packed_arrays_survive_model_dump_in_python_mode() -> None:
    event = completion()
    assert isinstance(event.model_dump()["token_ids"].numpy, np.ndarray)
