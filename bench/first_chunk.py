"""What a stream's first chunk costs the proxy's event loop: read whole, or with its prompt ids cut out.

vLLM's first chunk of a stream carries the prompt's ids (``return_token_ids``): for a long prompt they are
nearly all of its bytes. Read whole, the chunk's JSON becomes a Python int per id and then the packed
array of the event, all before the chunk's first bytes can go to the harness. Cut, the ids are taken out
of the chunk's bytes unread (the chunk's first bytes wait only for the rest), and read later straight
into the packed array, one stream's at a time on a turn of the loop of its own (proxy/deferred.py).

Both ways run the proxy's own code on the recorded vLLM chunk (``tests/fixtures/vllm/chat_stream.json``)
with prompts of several lengths, best of ``--repeats``. Prints per length the milliseconds before the
first bytes (``whole_ms``, ``cut_first_bytes_ms``), the later read (``cut_read_ms``) and both together
(``cut_total_ms``), and their ratios to ``whole_ms``; key figure last: ``first_bytes_over_whole`` at the
longest prompt.

    python -m bench.first_chunk [--lengths 10000,38000,100000] [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import orjson

from proxy.engine import _deltas, parse_chunk
from proxy.turns import TurnAssembler
from tests.support.standin_text import load_fixture


def first_chunk(length: int, seed: int = 0) -> bytes:
    """The recorded first chunk with a prompt of ``length`` ids (random, below a real vocabulary's size)."""
    chunk = dict(load_fixture("chat_stream.json")["chunks"][0])
    rng = random.Random(seed)
    chunk["prompt_token_ids"] = [rng.randrange(151_000) for _ in range(length)]
    chunk.pop("prompt_text", None)
    return orjson.dumps(chunk)


def best_ms(work: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def whole(payload: bytes) -> TurnAssembler:
    """The chunk read whole: its JSON parsed with the ids in it, the ids packed as the turn takes them."""
    assembler = TurnAssembler()
    assembler.add(parse_chunk(orjson.loads(payload)))
    return assembler


def cut(payload: bytes) -> TurnAssembler:
    """The chunk with its ids cut out: what runs before its first bytes go out."""
    deltas, error = _deltas([payload])
    assert error is None
    assembler = TurnAssembler()
    assembler.add(deltas[0])
    return assembler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="10000,38000,100000", help="Prompt lengths in ids, comma-separated.")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    lengths = [int(part) for part in args.lengths.split(",")]
    ratio = float("nan")
    for length in lengths:
        payload = first_chunk(length)
        read_whole, read_cut = whole(payload), cut(payload)
        read_cut.settle_prompt()
        if list(read_whole.prompt_token_ids) != list(read_cut.prompt_token_ids):
            raise SystemExit(f"{length} ids: the two ways read different ids")
        whole_ms = best_ms(lambda: whole(payload), args.repeats)
        first_ms = best_ms(lambda: cut(payload), args.repeats)
        pending = [cut(payload) for _ in range(args.repeats)]
        read_ms = best_ms(lambda: pending.pop().settle_prompt(), args.repeats)
        ratio = first_ms / whole_ms
        print(f"prompt_{length}_chunk_kb={len(payload) / 1024:.0f}")
        print(f"prompt_{length}_whole_ms={whole_ms:.3f} prompt_{length}_cut_first_bytes_ms={first_ms:.3f} "
              f"prompt_{length}_cut_read_ms={read_ms:.3f} prompt_{length}_cut_total_ms={first_ms + read_ms:.3f}")
        print(f"prompt_{length}_total_over_whole={(first_ms + read_ms) / whole_ms:.3f}")
        print(f"prompt_{length}_first_bytes_over_whole={ratio:.3f}")
    print(f"first_bytes_over_whole={ratio:.3f}")


if __name__ == "__main__":
    main()
