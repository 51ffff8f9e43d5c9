"""Bytes on Kafka per session: every event whole (as schema version 1 wrote them) versus prompt deltas.

Sessions of 10, 25, 50 and 100 turns shaped like a Qwen Code session (its own recorded system prompt and
14-tool list, about 39 kB of JSON Schema on every call; real Qwen token ids; replies of ~250 tokens; tool
outputs of ~2k tokens at the median, lognormal up to 8k), each call continuing the last exactly, are
encoded twice: ``full`` (a keyframe every call) and ``delta`` (what the proxy writes: a delta against the
previous call; a keyframe when the prompt outgrows :data:`schemas.prompt_chain.KEYFRAME_GROWTH` times
its chain's keyframe, and at the latest every :data:`schemas.prompt_chain.KEYFRAME_EVERY` calls). Each event is framed
as the proxy's producer frames it (one record per zstd batch, ``bench.event_size.batch_bytes``: what the
broker stores, topics keeping the producer's compression). Per size: bytes per session for both, the
ratio, and bytes per distinct token (the session's last prompt + reply: what a session holds once);
the fitted growth is the exponent of bytes against turns and against the session's distinct tokens
(log-log least squares over the four sizes: 2 is quadratic, 1 linear); a session's first ~18k tokens are
Qwen Code's system prompt and tools, so tokens grow slower than turns over this range (exponent ~0.84).

Choosing K (``--sweep``): every size again for a fixed interval K in 1, 8, 16, 32, 64, 128, unbounded, for
the growth rule alone (2, 3, 4, 8) and for both: the ratio at 50 and 100 turns, the growth exponent and
the worst walk at 100 turns (events and bytes a reader that starts cold reads to resolve the worst event:
its chain back to the keyframe). ``--broker``: the 50-turn session's events (full and delta) produced to two fresh topics on the
broker ``ROLLWIRE_KAFKA_BOOTSTRAP`` names, one record per send as the proxy does; the log segments' bytes
on disk (a local broker, ``ROLLWIRE_HOME``) and a read-back resolved through ``PromptChains`` compared with
the full events.

    python -m bench.log_size [--sessions N] [--broker]

Key figure last: ``bytes_ratio_50_turns`` (full / delta at 50 turns; goal >= 10).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import uuid
from collections.abc import Sequence

import numpy as np

from bench.event_size import batch_bytes
from bench.workloads import TokenSource, full_session, qwen_code_prompt
from schemas.codec import encode_event, event_headers
from schemas.completions import Completion
from schemas.prompt_chain import KEYFRAME_EVERY, KEYFRAME_GROWTH, PromptChains, write_session

TURNS = (10, 25, 50, 100)
TOOL_RESULT_TOKENS = 2000


def event_bytes(event: Completion) -> int:
    """What one event costs on the broker: its zstd record batch as the producer builds it."""
    return batch_bytes(encode_event(event), event.key(), event_headers(event))


def distinct_tokens(session: Sequence[Completion]) -> int:
    last = session[-1]
    return len(last.prompt_token_ids or ()) + len(last.token_ids or ())


def worst_walk(written: Sequence[Completion], sizes: Sequence[int]) -> tuple[int, int]:
    """The longest chain back to a keyframe (events) and the most bytes a cold reader reads to resolve
    one event (its chain, itself included)."""
    index = {e.event_id: i for i, e in enumerate(written)}
    worst_events = worst_bytes = 0
    for i, event in enumerate(written):
        events, total, j = 0, sizes[i], i
        while written[j].prompt_delta is not None:
            delta = written[j].prompt_delta
            assert delta is not None
            j = index[delta.parent_event_id]
            events += 1
            total += sizes[j]
        worst_events, worst_bytes = max(worst_events, events), max(worst_bytes, total)
    return worst_events, worst_bytes


def fitted_exponent(xs: Sequence[float], values: Sequence[float]) -> float:
    """The least-squares slope of log(values) against log(xs): 1 is linear, 2 quadratic."""
    slope, _ = np.polyfit(np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(values, dtype=float)), 1)
    return float(slope)


async def through_broker(full: list[Completion], delta: list[Completion]) -> dict[str, float]:
    """Produce both encodings to fresh topics one send at a time; segment bytes on disk and a resolved
    read-back (requires a running broker)."""
    from deploy.kafka import KafkaConfig
    from schemas.topics import Topic
    from schemas.transport import EventConsumer, EventProducer, ExtraTopic, KafkaSettings, ensure_topics
    from schemas.transport.admin import delete_topics
    from schemas.transport.consumer import topic_spec

    base = KafkaSettings()
    settings = base.model_copy(update={"topic_prefix": f"{base.topic_prefix}logsize-{uuid.uuid4().hex[:8]}."})
    names = {"full": settings.topic_prefix + "full", "delta": settings.topic_prefix + "delta"}
    await ensure_topics(settings, [ExtraTopic(name, 1) for name in names.values()])
    out: dict[str, float] = {}
    try:
        async with EventProducer(settings, service="log-size") as producer:
            for kind, events in (("full", full), ("delta", delta)):
                for event in events:
                    await producer.send(event, to=names[kind])
        data = KafkaConfig.from_env().data_dir
        for kind, name in names.items():
            segments = list((data / f"{name}-0").glob("*.log"))
            if segments:
                out[f"broker_segment_bytes_{kind}"] = sum(p.stat().st_size for p in segments)
        spec = topic_spec(settings, names["delta"], Topic.COMPLETIONS)
        chains = PromptChains()
        got: list[Completion] = []
        async with EventConsumer(settings, [spec], group_id=None, dead_letters=False) as consumer:
            while len(got) < len(delta):
                for received in await consumer.getmany(timeout_ms=1000):
                    assert isinstance(received.event, Completion)
                    got.append(chains.resolve(received.event))
        want = {e.event_id: e for e in full}
        out["broker_resolved_equal"] = float(all(
            g.prompt_token_ids == want[g.event_id].prompt_token_ids and
            g.request.messages == want[g.event_id].request.messages and
            g.request.tools == want[g.event_id].request.tools for g in got))
    finally:
        await delete_topics(settings.kafka_bootstrap, settings.topic_prefix)
    return out


def delta_figures(sessions: dict[int, list[list[Completion]]], keyframe_every: int,
                  keyframe_growth: float) -> dict[int, dict[str, float]]:
    """Per size: mean bytes per session written as deltas, the worst walk, the keyframes."""
    out: dict[int, dict[str, float]] = {}
    for turns, group in sessions.items():
        total = raw = ids = keyframes = walk_events = walk_bytes = 0
        for session in group:
            written = write_session(session, keyframe_every=keyframe_every, keyframe_growth=keyframe_growth)
            sizes = [event_bytes(e) for e in written]
            total += sum(sizes)
            raw += sum(len(encode_event(e)) for e in written)
            ids += sum(len(e.prompt_token_ids or ()) for e in written)
            keyframes += sum(e.prompt_delta is None for e in written)
            events, walked = worst_walk(written, sizes)
            walk_events, walk_bytes = max(walk_events, events), max(walk_bytes, walked)
        n = len(group)
        out[turns] = {"bytes": total / n, "raw": raw / n, "prompt_ids": ids / n, "keyframes": keyframes / n,
                      "walk_events": walk_events, "walk_bytes": walk_bytes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2, help="sessions per size (averaged)")
    parser.add_argument("--broker", action="store_true", help="also through the real broker (one 50-turn session)")
    parser.add_argument("--sweep", action="store_true", help="also other keyframe settings (K, growth)")
    args = parser.parse_args()

    source = TokenSource()
    harness = qwen_code_prompt()
    sessions: dict[int, list[list[Completion]]] = {}
    full: dict[int, dict[str, float]] = {}
    for turns in TURNS:
        sessions[turns] = [list(full_session(source, np.random.default_rng(1000 * turns + s),
                                             session_id=f"log-size-{turns}-{s}", turns=turns, harness=harness,
                                             tool_result_tokens=TOOL_RESULT_TOKENS))
                           for s in range(args.sessions)]
        group = sessions[turns]
        full[turns] = {
            "bytes": sum(event_bytes(e) for g in group for e in g) / len(group),
            "raw": sum(len(encode_event(e)) for g in group for e in g) / len(group),
            "prompt_ids": sum(len(e.prompt_token_ids or ()) for g in group for e in g) / len(group),
            "tokens": sum(distinct_tokens(g) for g in group) / len(group),
        }
    delta = delta_figures(sessions, KEYFRAME_EVERY, KEYFRAME_GROWTH)
    for turns in TURNS:
        f, d = full[turns], delta[turns]
        print(f"turns_{turns}_distinct_tokens={f['tokens']:.0f}")
        print(f"turns_{turns}_prompt_ids_full={f['prompt_ids']:.0f} turns_{turns}_prompt_ids_delta={d['prompt_ids']:.0f}")
        print(f"turns_{turns}_bytes_full={f['bytes']:.0f} turns_{turns}_bytes_delta={d['bytes']:.0f}")
        print(f"turns_{turns}_uncompressed_bytes_full={f['raw']:.0f} turns_{turns}_uncompressed_bytes_delta={d['raw']:.0f}")
        print(f"turns_{turns}_bytes_per_token_full={f['bytes'] / f['tokens']:.2f} "
              f"turns_{turns}_bytes_per_token_delta={d['bytes'] / f['tokens']:.2f}")
        print(f"turns_{turns}_keyframes={d['keyframes']:.1f} turns_{turns}_worst_walk_events={d['walk_events']:.0f} "
              f"turns_{turns}_worst_walk_bytes={d['walk_bytes']:.0f}")
        print(f"turns_{turns}_bytes_ratio={f['bytes'] / d['bytes']:.2f}", flush=True)

    turns = list(TURNS)
    print(f"growth_exponent_full={fitted_exponent(turns, [full[t]['bytes'] for t in turns]):.2f}")
    print(f"growth_exponent_delta={fitted_exponent(turns, [delta[t]['bytes'] for t in turns]):.2f}")
    print(f"growth_exponent_distinct_tokens={fitted_exponent(turns, [full[t]['tokens'] for t in turns]):.2f}")
    tokens = [full[t]["tokens"] for t in turns]
    print(f"growth_exponent_vs_tokens_full={fitted_exponent(tokens, [full[t]['bytes'] for t in turns]):.2f}")
    print(f"growth_exponent_vs_tokens_delta={fitted_exponent(tokens, [delta[t]['bytes'] for t in turns]):.2f}")
    per_token = [delta[t]["bytes"] / full[t]["tokens"] for t in turns]
    print(f"delta_bytes_per_token_min={min(per_token):.2f} delta_bytes_per_token_max={max(per_token):.2f}")
    print(f"keyframe_every={KEYFRAME_EVERY} keyframe_growth={KEYFRAME_GROWTH:g}")

    if args.sweep:
        settings = [(k, math.inf) for k in (1, 8, 16, 32, 64, 128, 10_000)] + \
            [(10_000, g) for g in (2.0, 3.0, 4.0, 8.0)] + [(k, 4.0) for k in (32, 64)]
        for k, growth in settings:
            figures = delta_figures(sessions, k, growth)
            name = f"k{k}_g{growth:g}"
            print(f"{name}_ratio_50_turns={full[50]['bytes'] / figures[50]['bytes']:.2f} "
                  f"{name}_ratio_100_turns={full[100]['bytes'] / figures[100]['bytes']:.2f} "
                  f"{name}_exponent={fitted_exponent(turns, [figures[t]['bytes'] for t in turns]):.2f} "
                  f"{name}_worst_walk_events_100={figures[100]['walk_events']:.0f} "
                  f"{name}_worst_walk_bytes_100={figures[100]['walk_bytes']:.0f}", flush=True)

    if args.broker:
        session = sessions[50][0]
        for name, value in asyncio.run(through_broker(session, write_session(session))).items():
            print(f"{name}={value:.0f}")

    ratio = full[50]["bytes"] / delta[50]["bytes"]
    assert math.isfinite(ratio)
    print(f"bytes_ratio_50_turns={ratio:.2f}")


if __name__ == "__main__":
    main()
