"""Sampled tokens' logprob entries as each provider API writes them, from the engine's own entries.

The engine gives one entry per sampled token: the chat endpoint's is OpenAI's shape already (``token``,
``logprob``, ``bytes``, ``top_logprobs`` alternatives); the token endpoints' (``/inference/v1/generate``)
has ids only (``token_id``), and is written here as vLLM's ``return_tokens_as_token_ids`` writes a token,
``token_id:<id>``. A harness that asked for logprobs gets these; the values are the ones its call's event
records.

- :func:`openai_entries`: Chat Completions' ``logprobs.content`` and the Responses API's
  ``output_text.logprobs`` (one shape).
- :func:`stream_entries`: the Responses API's ``response.output_text.delta`` form (no bytes).
- :func:`gemini_logprobs`: Gemini's ``logprobsResult`` and ``avgLogprobs``.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import BadRequest

MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and vLLM's default --max-logprobs


def checked_top_logprobs(value: int | None, param: str) -> int:
    """How many alternatives per token a harness asked for (0 when none); BadRequest naming ``param``
    outside 0..MAX_TOP_LOGPROBS."""
    if value is None:
        return 0
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}", param=param)
    return value


def _named(entry: dict[str, Any]) -> str:
    token = entry.get("token")
    return token if isinstance(token, str) else f"token_id:{entry.get('token_id')}"


def _bytes(entry: dict[str, Any], token: str) -> list[int]:
    given = entry.get("bytes")
    return given if isinstance(given, list) else list(token.encode("utf-8", errors="replace"))


def openai_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """One token's entry in OpenAI's shape: the engine's as it came where it is that shape already."""
    if "token" in entry:
        return entry
    token = _named(entry)
    return {"token": token, "logprob": entry.get("logprob"), "bytes": None,
            "top_logprobs": [{"token": _named(top), "logprob": top.get("logprob"), "bytes": None}
                             for top in entry.get("top_logprobs") or () if isinstance(top, dict)]}


def usable(values: list[float | None], entries: list[dict[str, Any]]) -> bool:
    """Whether the engine gave one entry per sampled token (else only the values are known)."""
    return len(entries) == len(values) and all(isinstance(entry, dict) for entry in entries)


def openai_entries(values: list[float | None], entries: list[dict[str, Any]], *,
                   bytes_always: bool = False) -> list[dict[str, Any]]:
    """Each sampled token's entry in OpenAI's shape: the engine's where it gave one per token, else the
    values alone (``token`` empty). ``bytes_always``: a token's bytes are listed even where the engine
    named it by id only (the Responses API's entries type them as always there)."""
    if not usable(values, entries):
        return [{"token": "", "logprob": v, "bytes": [] if bytes_always else None, "top_logprobs": []} for v in values]
    out = [openai_entry(entry) for entry in entries]
    if bytes_always:
        out = [_with_bytes(entry) for entry in out]
    return out


def _alternatives(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [top for top in entry.get("top_logprobs") or () if isinstance(top, dict)]


def _with_bytes(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with every token's bytes listed (its own, and its alternatives')."""
    tops = _alternatives(entry)
    if isinstance(entry.get("bytes"), list) and all(isinstance(top.get("bytes"), list) for top in tops) \
            and len(tops) == len(entry.get("top_logprobs") or ()):
        return entry
    token = _named(entry)
    return {**entry, "token": token, "bytes": _bytes(entry, token),
            "top_logprobs": [{**top, "token": _named(top), "bytes": _bytes(top, _named(top))} for top in tops]}


def stream_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's streamed form of entries in OpenAI's shape: token, logprob, alternatives."""
    return [{"token": _named(entry), "logprob": entry.get("logprob"),
             "top_logprobs": [{"token": _named(top), "logprob": top.get("logprob")} for top in _alternatives(entry)]}
            for entry in entries]


def _gemini_candidate(entry: dict[str, Any]) -> dict[str, Any]:
    candidate: dict[str, Any] = {"token": _named(entry), "logProbability": entry.get("logprob")}
    if isinstance(entry.get("token_id"), int):
        candidate["tokenId"] = entry["token_id"]
    return candidate


def gemini_logprobs(values: list[float | None], entries: list[dict[str, Any]],
                    token_ids: list[int]) -> dict[str, Any]:
    """Gemini's ``logprobsResult`` for the sampled tokens ``token_ids``: the chosen token of each step and
    its alternatives (``topCandidates``, as many as were asked for), named by the engine."""
    if not usable(values, entries):
        entries = [{"logprob": v} for v in values]
    chosen, tops = [], []
    for i, entry in enumerate(entries):
        named = dict(entry)
        if i < len(token_ids):
            named.setdefault("token_id", token_ids[i])
        chosen.append(_gemini_candidate(named))
        tops.append({"candidates": [_gemini_candidate(top) for top in _alternatives(entry)]})
    return {"topCandidates": tops, "chosenCandidates": chosen}


def average(values: list[float | None]) -> float | None:
    """The mean logprob of the sampled tokens (Gemini's ``avgLogprobs``); None when none is known."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
