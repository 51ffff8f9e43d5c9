"""The floor of a relay with durable capture: bytes passed through, each stream's end held for Kafka's ack.

``bench.proxy_overhead --capture-floor`` puts this process in front of the same stand-in as rollwire, as a
path of its own in the same rounds. It does the least any proxy that keeps rollwire's promise must do: it
does not parse the request or the stream; it asks the engine for the token ids and logprobs rollwire
asks for (added to the body's bytes, so the engine does the same work for both), relays every read of the
engine's stream as it comes (those fields included: nothing is parsed to take them out), holds
back the read that carries ``data: [DONE]``, writes a record to Kafka through producers set up as the
proxy's (:class:`bench.kafka_floor.KafkaFloor`) and sends the held bytes only once the broker has it.
The records are rollwire's own events of the same requests (read back from its completions topic by the
bench), so the bytes on the wire to the broker are the same. Two ways of writing them:

- ``whole``: the whole event at the stream's end, as rollwire writes it now;
- ``early``: the event's prompt part (the event without its sampled part) sent when the engine's first
  read comes in, not waited for, and a record the size of the event without its prompt (request messages,
  tools, prompt ids dropped) at the end; the end waits for both acks. This is the best a proxy could do
  that wrote the prompt before the first token and the rest as a small record at the end.

The path's added time over ``direct`` is what the machine costs a durable-capture proxy before any of
rollwire's own work: the relay's hop (nginx's path measures that alone) and the ack at the end.

    python -m bench.capture_floor --port P --upstream URL --records FILE --mode whole|early
        --topic T [--compress]   (the broker: ROLLWIRE_KAFKA_BOOTSTRAP)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import pickle
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import uvloop
from aiohttp import web

from bench.kafka_floor import CapturedRecord, KafkaFloor
from schemas.transport import KafkaSettings

_END = b"data: [DONE]"
# What rollwire asks of the engine for every call besides the harness's request (proxy.engine.engine_body):
# the token ids and logprobs it records, and the usage chunk. Put in front of the body's own keys, so that
# a key the harness sent itself wins (the last of a repeated key counts).
_CAPTURE_ASKS = b'"return_token_ids":true,"logprobs":true,"stream_options":{"include_usage":true},'


def with_capture_asks(body: bytes) -> bytes:
    """The request body with rollwire's engine asks added, by bytes (the floor parses nothing): the engine
    then does for the floor what it does for rollwire (prompt ids in the first chunk, an id and a logprob
    entry per token), and the floor relays those bytes as they are."""
    start = body.find(b"{")
    if start < 0:
        return body
    rest = body[start + 1:]
    asks = _CAPTURE_ASKS if rest.lstrip()[:1] != b"}" else _CAPTURE_ASKS[:-1]  # an empty object: no comma
    return body[:start + 1] + asks + rest


@dataclass(frozen=True)
class FloorRecord:
    """One of rollwire's events as the floor writes it: ``whole`` at the end, or ``prompt`` early and ``rest``
    at the end."""

    key: bytes | None
    headers: list[tuple[str, bytes]]
    whole: bytes
    prompt: bytes
    rest: bytes


def split_record(record: CapturedRecord) -> FloorRecord:
    """The record whole, and as the two records an early-prompt proxy would write: the event without its
    sampled part (token ids, logprobs, message) and the event without its prompt (request messages and
    tools, prompt ids)."""
    event = orjson.loads(record.value)
    rest = {k: v for k, v in event.items() if k != "prompt_token_ids"}
    rest["request"] = {k: v for k, v in event.get("request", {}).items() if k not in ("messages", "tools")}
    prompt = {k: v for k, v in event.items() if k not in ("token_ids", "logprobs", "message")}
    return FloorRecord(record.key, record.headers, record.value, orjson.dumps(prompt), orjson.dumps(rest))


def save_records(records: list[CapturedRecord], path: Path) -> None:
    path.write_bytes(pickle.dumps([split_record(record) for record in records]))


def load_records(path: Path) -> list[FloorRecord]:
    records: list[FloorRecord] = pickle.loads(path.read_bytes())
    if not records:
        raise SystemExit(f"{path}: no records")
    return records


class CaptureFloor:
    """The relay: one upstream client, the producers, the records used round-robin."""

    def __init__(self, upstream: str, kafka: KafkaSettings, topic: str, compress: bool, records: list[FloorRecord],
                 mode: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._floor_args = (kafka, topic, compress)
        self.floor: KafkaFloor | None = None
        self.records = itertools.cycle(records)
        self.mode = mode
        self.client: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                            timeout=aiohttp.ClientTimeout(total=300), auto_decompress=False)
        kafka, topic, compress = self._floor_args
        self.floor = KafkaFloor(kafka, topic, compress=compress)  # aiokafka's clients are made in a running loop
        await self.floor.start()

    async def stop(self, app: web.Application) -> None:
        if self.client is not None:
            await self.client.close()
        if self.floor is not None:
            await self.floor.stop()

    async def _send(self, record: FloorRecord, value: bytes) -> asyncio.Future[object]:
        assert self.floor is not None
        producer = self.floor.producer_for(record.key)
        return await producer.send(self.floor.topic, value, key=record.key, headers=record.headers)

    async def relay(self, request: web.Request) -> web.StreamResponse:
        assert self.client is not None
        body = await request.read()
        record = next(self.records)
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with self.client.post(self.upstream + request.path, data=with_capture_asks(body),
                                    headers=headers) as upstream:
            if upstream.status != 200:
                return web.Response(status=upstream.status, body=await upstream.read(),
                                    content_type=upstream.content_type)
            response = web.StreamResponse(headers={"content-type": upstream.headers.get("content-type",
                                                                                        "text/event-stream")})
            await response.prepare(request)
            early: asyncio.Future[object] | None = None
            held = b""
            async for data in upstream.content.iter_any():
                if self.mode == "early" and early is None:
                    early = await self._send(record, record.prompt)
                if held or _END in data:
                    held += data  # the end of the stream: sent once the record is on the broker
                    continue
                await response.write(data)
            if self.mode == "early":
                ends = [await self._send(record, record.rest)] + ([early] if early is not None else [])
                await asyncio.gather(*ends)
            else:
                await (await self._send(record, record.whole))
            await response.write(held)
            await response.write_eof()
            return response

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="The engine's base URL (the stand-in).")
    parser.add_argument("--records", type=Path, required=True, help="Records saved by save_records.")
    parser.add_argument("--topic", required=True, help="A scratch topic the records are written to.")
    parser.add_argument("--mode", choices=("whole", "early"), default="whole")
    parser.add_argument("--compress", action="store_true", help="zstd in the producer (else the broker's).")
    args = parser.parse_args()
    kafka = KafkaSettings()
    floor_proxy = CaptureFloor(args.upstream, kafka, args.topic, args.compress, load_records(args.records), args.mode)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(floor_proxy.start)
    app.on_cleanup.append(floor_proxy.stop)
    app.router.add_get("/health", floor_proxy.health)
    app.router.add_post("/{path:.*}", floor_proxy.relay)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
