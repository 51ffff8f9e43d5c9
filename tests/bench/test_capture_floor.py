"""bench.capture_floor: the bare relay with durable capture relays the engine's stream whole and writes
the record (or its two parts, in order) to the real broker, the figures' premise."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from bench.capture_floor import save_records, split_record, with_capture_asks
from bench.kafka_floor import CapturedRecord
from tests.support.standin_engine import StandinConfig, create_app
from schemas.codec import encode_record
from schemas.topics import Topic
from schemas.transport import KafkaSettings
from tests.samples import completion
from tests.servers import free_port, serve


def _record() -> CapturedRecord:
    encoded = encode_record(completion("floor-1", prompt_len=300), "test")
    return CapturedRecord(encoded.key, encoded.value, encoded.headers)


def test_a_record_splits_into_its_prompt_part_and_the_rest() -> None:
    record = _record()
    parts = split_record(record)
    whole, prompt, rest = (orjson.loads(v) for v in (parts.whole, parts.prompt, parts.rest))
    assert whole["prompt_token_ids"] == prompt["prompt_token_ids"] and "prompt_token_ids" not in rest
    assert prompt["request"]["messages"] == whole["request"]["messages"] and "messages" not in rest["request"]
    assert "token_ids" in whole and "token_ids" not in prompt and rest["token_ids"] == whole["token_ids"]
    assert len(parts.rest) < len(parts.whole) / 2 and len(parts.prompt) < len(parts.whole)


def test_the_engine_is_asked_for_what_rollwire_asks_and_the_harness_keys_win() -> None:
    asked = orjson.loads(with_capture_asks(b' {"model": "m", "logprobs": false}'))
    assert asked == {"return_token_ids": True, "logprobs": False, "stream_options": {"include_usage": True},
                     "model": "m"}
    assert orjson.loads(with_capture_asks(b"{ }"))["return_token_ids"] is True


async def _topic_values(kafka: KafkaSettings, topic: str, want: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka.kafka_bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    values: list[bytes] = []
    try:
        deadline = time.monotonic() + 10
        while len(values) < want and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=200)).values():
                values += [r.value for r in batch]
    finally:
        await consumer.stop()
    return values


@pytest.mark.parametrize("mode", ["whole", "early"])
async def test_the_stream_is_relayed_whole_and_the_record_written(mode: str, kafka: KafkaSettings,
                                                                      tmp_path: Path) -> None:
    record = _record()
    parts = split_record(record)
    records = tmp_path / "records.pickle"
    save_records([record], records)
    topic = kafka.registry().name(Topic.COMPLETIONS)
    port = free_port()
    with serve(create_app(StandinConfig(latency_ms=1, reply_tokens=6))) as engine:
        relay = subprocess.Popen([sys.executable, "-m", "bench.capture_floor", "--port", str(port),
                                  "--upstream", engine, "--records", str(records), "--topic", topic, "--mode", mode],
                                 env={**os.environ, "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap})
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline and relay.poll() is None, "the relay did not come up"
                    await asyncio.sleep(0.1)
                body = {"model": "rollwire-tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as reply:
                    assert reply.status_code == 200
                    lines = [line async for line in reply.aiter_lines() if line.startswith("data:")]
                    written = await _topic_values(kafka, topic, 2 if mode == "early" else 1)
        finally:
            relay.terminate()
            relay.wait(10)
    assert lines[-1] == "data: [DONE]"
    tokens = [t for line in lines[:-1] for c in orjson.loads(line[5:])["choices"] for t in c.get("token_ids") or ()]
    assert len(tokens) == 6  # every chunk of the engine's stream came through
    assert "prompt_token_ids" in orjson.loads(lines[0][5:])  # the engine was asked for them, as by rollwire
    assert written == ([parts.prompt, parts.rest] if mode == "early" else [parts.whole])
