"""Schema versions: which versions of each event a reader takes, and how a version is introduced and retired.

Every event carries ``schema_version``; its model declares the versions it reads as a ``Literal`` and the
one it writes as the default (``Completion``: ``Literal[1, 2] = 2``). :func:`supported_versions` is what
the codec checks a record against; a record of any other version is dead-lettered as
``unsupported_schema_version``, never guessed at.

Introducing version N+1 (done for ``completion`` 2: prompt deltas, ``schemas/prompt_chain.py``):

1. The model reads N and N+1 and writes N+1. Version N must keep validating unchanged: new fields are
   optional, and what N meant is what N+1 means without them (a v1 completion is a keyframe: it resolves to
   itself).
2. Readers are upgraded before writers: deploy consumers that read N+1 first, then the writers.
3. Recorded fixtures of version N stay in the tests (``tests/fixtures/sessions`` are v1), and a test reads
   a log holding both versions and derives the same views from it.

Retiring version N (``Literal[N, N+1]`` becomes ``Literal[N+1]``) is allowed only when all hold:

1. No writer has written N since some time T (every proxy / service instance runs a release that writes
   N+1; the ``rollwire-schema-version`` header of the newest records says so).
2. No retained record of version N is left: the topic's retention (``schemas/topics.py``; ``-1`` keeps
   forever, so for those topics this means step 3) has passed since T, or
3. the retained log was rewritten at N+1 (replayed through the current model into a new topic, or
   re-derived views checked equal), and the fixtures at N were re-recorded or upgraded.
4. The consumers' dead-letter topic shows no ``unsupported_schema_version`` records for the type in a
   rehearsal against a copy of the log with N removed from the reader.

Then remove N from the ``Literal``, drop the code that only N needed, and write the retirement in this
docstring's history below.

History: ``completion`` 1 (full prompt on every event) → 2 (prompt deltas); ``policy.weights_updated`` 1 →
2 (the proxy tier's part: ``update_id``, ``coordinator``, ``proxies``); nothing retired yet.
"""

from __future__ import annotations

from functools import cache
from typing import Literal, get_args, get_origin

from schemas.envelope import Event


@cache
def supported_versions(model: type[Event]) -> frozenset[int]:
    """The schema versions ``model`` reads: the values of its ``schema_version`` Literal."""
    field = model.model_fields["schema_version"]
    annotation = field.annotation
    if get_origin(annotation) is Literal:
        return frozenset(int(v) for v in get_args(annotation))
    return frozenset({int(field.default)})


def written_version(model: type[Event]) -> int:
    """The schema version ``model`` writes (its default)."""
    return int(model.model_fields["schema_version"].default)
