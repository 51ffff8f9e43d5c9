"""Follow the completions topic and print one line per model call (session, sequence, tokens, logprob sum).

    .venv/bin/python examples/tail_completions.py [--from-beginning]

Reads ROLLWIRE_KAFKA_BOOTSTRAP and ROLLWIRE_TOPIC_PREFIX like every rollwire service.
"""

from __future__ import annotations

import argparse
import asyncio
import math

from schemas.completions import Completion
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings


async def tail(from_beginning: bool) -> None:
    async with EventConsumer(KafkaSettings(), [Topic.COMPLETIONS], group_id=None,
                             from_beginning=from_beginning, dead_letters=False) as consumer:
        async for received in consumer:
            event = received.event
            assert isinstance(event, Completion)
            prompt = len(event.prompt_token_ids or ())
            sampled = len(event.token_ids or ())
            total = sum(v for v in (event.logprobs or ()) if not math.isnan(v))
            print(f"{event.session_id} #{event.sequence} {event.api} {event.status} "
                  f"prompt={prompt} sampled={sampled} logprob_sum={total:.3f} finish={event.finish_reason}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-beginning", action="store_true")
    asyncio.run(tail(parser.parse_args().from_beginning))
