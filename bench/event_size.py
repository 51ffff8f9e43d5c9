"""Bytes on Kafka per captured token: packed arrays versus JSON number lists, side by side.

Each completion event is framed as the producer frames it (aiokafka's record batch builder, zstd, one
record per batch as the proxy sends them), which is what the broker stores since topics keep the
producer's compression. The cost of the sampled tokens is measured at the margin: the batch with the
event's token ids and logprobs minus the batch of the same event without them, over the sampled tokens.
The same events with the arrays as JSON number lists (how vLLM returns them) are the baseline. Events
are written whole here (keyframes, ``keyframe_every=1``) so that every figure is per event as captured;
what prompt deltas save per session is ``python -m bench.log_size``.

    python -m bench.event_size [--sessions N]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from bench.workloads import TokenSource, session_completions
from schemas.codec import encode_event, event_headers
from schemas.completions import Completion


def batch_bytes(value: bytes, key: bytes, headers: list[tuple[str, bytes]]) -> int:
    """Size of a zstd record batch holding one record, exactly as the producer builds it."""
    builder = DefaultRecordBatchBuilder(2, DefaultRecordBatch.CODEC_ZSTD, is_transactional=False,
                                        producer_id=1, producer_epoch=0, base_sequence=0,
                                        batch_size=len(value) + 4096)
    builder.append(0, timestamp=None, key=key, value=value, headers=headers)
    return len(builder.build())


def json_lists_value(event: Completion, with_sampled: bool) -> bytes:
    """The event with its arrays as JSON number lists (floats as Python prints vLLM's values)."""
    document = json.loads(encode_event(event))
    document["prompt_token_ids"] = event.prompt_token_ids.tolist()
    if with_sampled:
        document["token_ids"] = event.token_ids.tolist()
        document["logprobs"] = [float(v) for v in event.logprobs.numpy.astype(np.float64)]
    else:
        document.pop("token_ids"), document.pop("logprobs")
    return json.dumps(document, separators=(",", ":")).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    source = TokenSource()
    totals = dict.fromkeys(["sampled", "prompt", "packed_full", "packed_margin", "json_full",
                            "json_margin", "packed_raw_margin"], 0)
    events = 0
    for s in range(args.sessions):
        for event in session_completions(source, rng, session_id=f"bench-{s}", turns=args.turns,
                                         keyframe_every=1):
            key, headers = event.key(), event_headers(event)
            without = event.model_copy(update={"token_ids": None, "logprobs": None})
            full_value, bare_value = encode_event(event), encode_event(without)
            full = batch_bytes(full_value, key, headers)
            totals["packed_full"] += full
            totals["packed_margin"] += full - batch_bytes(bare_value, key, headers)
            totals["packed_raw_margin"] += len(full_value) - len(bare_value)
            json_full = batch_bytes(json_lists_value(event, True), key, headers)
            totals["json_full"] += json_full
            totals["json_margin"] += json_full - batch_bytes(json_lists_value(event, False), key, headers)
            totals["sampled"] += len(event.token_ids)
            totals["prompt"] += len(event.prompt_token_ids)
            events += 1

    sampled, all_tokens = totals["sampled"], totals["sampled"] + totals["prompt"]
    print(f"events={events}")
    print(f"sampled_tokens={sampled}")
    print(f"prompt_tokens={totals['prompt']}")
    print(f"packed_uncompressed_bytes_per_token={totals['packed_raw_margin'] / sampled:.2f}")
    print(f"event_bytes_per_token_all_packed={totals['packed_full'] / all_tokens:.2f}")
    print(f"event_bytes_per_token_all_json_lists={totals['json_full'] / all_tokens:.2f}")
    print(f"json_lists_bytes_per_token={totals['json_margin'] / sampled:.2f}")
    print(f"ratio_packed_vs_json_lists={totals['packed_margin'] / totals['json_margin']:.3f}")
    print(f"bytes_per_token={totals['packed_margin'] / sampled:.2f}")


if __name__ == "__main__":
    main()
