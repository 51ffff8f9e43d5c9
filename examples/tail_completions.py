"""Follow the completions topic and print one line per model call (session, sequence, tokens, logprob sum).

    .venv/bin/python examples/tail_completions.py [--from-beginning]

Prompts are resolved through :class:`schemas.prompt_chain.PromptChains` (a v2 event may be a delta against
an earlier call of its session): ``prompt=`` is the whole prompt, and ``(+N new)`` what the event itself
carried. A tail that starts at the end of the log has not read the parents of the first deltas it sees:
those lines say ``prompt=? (+N new, parent not read)`` until the session's next keyframe.

Reads ROLLWIRE_KAFKA_BOOTSTRAP and ROLLWIRE_TOPIC_PREFIX like every rollwire service.
"""

from __future__ import annotations

import argparse
import asyncio
import math

from schemas.completions import Completion
from schemas.prompt_chain import MissingPromptParent, PromptChains
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings


async def tail(from_beginning: bool) -> None:
    async with EventConsumer(KafkaSettings(), [Topic.COMPLETIONS], group_id=None,
                             from_beginning=from_beginning, dead_letters=False) as consumer:
        chains = PromptChains()
        async for received in consumer:
            event = received.event
            assert isinstance(event, Completion)
            carried = len(event.prompt_token_ids or ())
            try:
                full = chains.resolve(event)
                prompt = str(len(full.prompt_token_ids or ()))
                if event.prompt_delta is not None:
                    prompt += f" (+{carried} new)"
            except MissingPromptParent:
                prompt = f"? (+{carried} new, parent not read)"
            sampled = len(event.token_ids or ())
            total = sum(v for v in (event.logprobs or ()) if not math.isnan(v))
            print(f"{event.session_id} #{event.sequence} {event.api} {event.status} "
                  f"prompt={prompt} sampled={sampled} logprob_sum={total:.3f} finish={event.finish_reason}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-beginning", action="store_true")
    asyncio.run(tail(parser.parse_args().from_beginning))
