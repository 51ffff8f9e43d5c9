"""The engine's token-in/token-out endpoints: render, generate, derender, detokenize (vLLM ``--enable-scale-out``).

vLLM 0.32 serves, besides its OpenAI routes:

- ``POST /v1/chat/completions/render``: an ordinary chat request → the prompt ids the chat template gives
  and vLLM's own sampling parameters for it (a ``GenerateRequest``);
- ``POST /inference/v1/generate``: that object, with any ``token_ids`` → the sampled ids, their logprobs
  (one per id), the finish and stop reasons and the weight version spans (called whole: the reply is
  parsed once it is complete, see ``proxy/calls.py``);
- ``POST /v1/chat/completions/derender``: a generate reply + the chat request → a chat completion parsed
  by the server's own reasoning and tool-call parsers;
- ``POST /detokenize``: ids → text.

So the prompt can be any token sequence the proxy builds, and the reply is still parsed by vLLM. Without
``--enable-scale-out`` the first three answer 403 (404 on older servers): :class:`TokenApi` then reports
itself unavailable once, and the proxy renders prompts through the chat endpoint as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from proxy.engine import error_from_response, parse_response, translate_http_error

from proxy.turns import EngineTurn, ends_on_end_id
from proxy.errors import EngineFailed, ProxyError
from schemas.completions import Usage

logger = logging.getLogger(__name__)

_JSON = {"content-type": "application/json"}
_MISSING_STATUSES = (403, 404, 405, 501)


class TokenApiMissing(Exception):
    """The engine does not serve the token-in/token-out endpoints."""


@dataclass(slots=True)
class Generation:
    """What ``/inference/v1/generate`` sampled for one prompt."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    # generate's own entry per token (``token_id``, ``logprob``, ``rank``, ``top_logprobs``): no token
    # strings, which a harness that asked for logprobs gets in vLLM's ``token_id:<id>`` form.
    logprob_entries: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[dict[str, Any]] | None = None
    usage: Usage | None = None
    raw: dict[str, Any] | None = None

    @property
    def ends_on_end_id(self) -> bool:
        """The last id is one of the engine's end ids, which stopped the turn (see
        :func:`proxy.engine.ends_on_end_id`): the tokenizer's end of sequence, or a stop token id."""
        return ends_on_end_id(self.finish_reason, self.stop_reason, self.token_ids)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the turn, if one did."""
        return self.stop_reason if self.finish_reason == "stop" and isinstance(self.stop_reason, str) else None

    def response(self, model: str) -> dict[str, Any]:
        """The generate reply in the shape derender takes (tokens output mode), without the end id that
        stopped it: the chat endpoint never decodes that id into the reply's text either (the render asks
        for special tokens to be kept, for the tool parser, so derender would), and the parsers must not
        see it. Its logprobs are generate's own entries (alternatives included), which derender gives back
        with their token strings and bytes."""
        ids, values, entries = self.token_ids, self.logprobs, self.logprob_entries
        if self.ends_on_end_id:
            ids, values, entries = ids[:-1], values[:-1], entries[:-1]
        if len(entries) != len(ids) or any(entry.get("logprob") is None for entry in entries):
            entries = [{"token_id": t, "logprob": lp if lp is not None else 0.0} for t, lp in
                       zip(ids, values or [None] * len(ids))]
        return {"model": model, "output_mode": "tokens", "choices": [{
            "index": 0, "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
            "token_ids": ids, "logprobs": {"content": entries} if values else None}]}


def cut_at_stop_string(turn: EngineTurn, stop: str) -> None:
    """Cut a derendered turn's text where the stop string ``stop`` begins, as vLLM's chat endpoint cuts its
    output text (derender decodes every id it is given, the stop string's too). The turn stopped the first
    time the string appeared, so its first occurrence is the one: in the reasoning, which comes first
    (then nothing after it was text), else in the content. Its ids and logprobs stay as sampled."""
    if turn.reasoning is not None and (at := turn.reasoning.find(stop)) >= 0:
        turn.reasoning, turn.content = turn.reasoning[:at], None
    elif turn.content is not None and (at := turn.content.find(stop)) >= 0:
        turn.content = turn.content[:at]


_TOKEN_TEXTS = 4096  # token texts remembered (end-of-sequence ids and their alternatives: few)


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]]:
    block = choice.get("logprobs") or {}
    return list(block.get("content") or ())


def _usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    return Usage(prompt_tokens=raw.get("prompt_tokens") or 0, completion_tokens=raw.get("completion_tokens") or 0)


class TokenApi:
    """Client for the token endpoints of one vLLM server (shares the engine's HTTP client)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self.available: bool | None = None  # None until the first call tells
        self._token_texts: dict[int, str] = {}

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self._client.post(path, content=orjson.dumps(body), headers=_JSON)
        except httpx.HTTPError as exc:
            raise translate_http_error(exc) from exc
        if response.status_code in _MISSING_STATUSES and path not in ("/detokenize", "/tokenize"):
            if self.available is not True:
                self.available = False
                logger.warning("the engine does not serve %s (HTTP %d): prompts are rendered by its chat "
                               "endpoint instead; start vLLM with --enable-scale-out for exact-token "
                               "continuation", path, response.status_code)
                raise TokenApiMissing(path)
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.text)
        try:
            document = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise EngineFailed(f"engine {path} reply is not JSON: {response.text[:200]}") from exc
        if not isinstance(document, dict):
            raise EngineFailed(f"engine {path} reply is not an object: {response.text[:200]}")
        self.available = True
        return document

    async def probe(self, model: str) -> bool:
        """Whether the engine serves the token endpoints (asked once, with a one-word render)."""
        if self.available is None:
            try:
                await self.render({"model": model, "messages": [{"role": "user", "content": "d"}]})
            except TokenApiMissing:
                pass
        return bool(self.available)

    async def render(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        """The generate request vLLM makes of a chat request: ``token_ids`` and ``sampling_params``."""
        rendered = await self._post("/v1/chat/completions/render", {**chat_body, "stream": False})
        ids = rendered.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise EngineFailed("engine render reply has no token_ids")
        return rendered

    async def render_ids(self, chat_body: dict[str, Any]) -> list[int]:
        return list((await self.render(chat_body))["token_ids"])

    @staticmethod
    def generate_body(rendered: dict[str, Any], token_ids: list[int], max_tokens: int | None) -> dict[str, Any]:
        sampling = dict(rendered.get("sampling_params") or {})
        if max_tokens is not None:
            sampling["max_tokens"] = max_tokens
        body = {key: value for key, value in rendered.items() if value is not None and key not in (
            "token_offsets", "features", "content_parts", "request_id")}
        body.update(token_ids=token_ids, sampling_params=sampling, stream=False, output_mode="tokens")
        return body

    async def generate(self, body: dict[str, Any]) -> Generation:
        document = await self._post("/inference/v1/generate", body)
        try:
            choice = document["choices"][0]
            entries = _logprob_entries(choice)
            return Generation(token_ids=list(choice.get("token_ids") or ()),
                              logprobs=[entry.get("logprob") for entry in entries], logprob_entries=entries,
                              finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
                              weight_versions=choice.get("weight_versions"), usage=_usage(document.get("usage")),
                              raw=document)
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise EngineFailed(f"engine generate reply has an unexpected shape: {str(document)[:200]}") from exc

    async def derender(self, generation: Generation, chat_body: dict[str, Any], prompt: list[int],
                       model: str) -> EngineTurn:
        """The reply parsed by the engine's own reasoning and tool-call parsers, with the exact ids."""
        document = await self._post("/v1/chat/completions/derender", {
            "model": model, "generate_response": generation.response(model),
            "chat_request": {**chat_body, "stream": False}, "prompt_tokens": len(prompt),
            "prompt_token_ids": prompt[-16:]})
        try:
            parsed = parse_response(document)
        except (TypeError, AttributeError, KeyError) as exc:
            raise EngineFailed(f"engine derender reply has an unexpected shape: {str(document)[:200]}") from exc
        if generation.stop_string is not None:
            cut_at_stop_string(parsed, generation.stop_string)
        finish = generation.finish_reason
        if finish == "stop" and parsed.tool_calls:
            finish = "tool_calls"  # as the chat endpoint says it (derender itself may say "stop")
        usage = generation.usage or Usage(prompt_tokens=len(prompt), completion_tokens=len(generation.token_ids))
        return EngineTurn(prompt_token_ids=prompt, token_ids=generation.token_ids, logprobs=generation.logprobs,
                          logprob_entries=await self._named_entries(generation, parsed.logprob_entries, model),
                          content=parsed.content,
                          reasoning=parsed.reasoning, tool_calls=parsed.tool_calls,
                          finish_reason=finish, usage=usage, response_id=parsed.response_id,
                          stop_reason=generation.stop_reason)

    async def _named_entries(self, generation: Generation, derendered: list[dict[str, Any]],
                             model: str) -> list[dict[str, Any]]:
        """One logprob entry per sampled id with its token string: derender's (it names every id it was
        given), and for the end id it was not given, the entry generate made, named through
        :meth:`token_text` (as vLLM's chat endpoint names it: ``<|im_end|>``, ``<|endoftext|>``; an entry,
        never text). generate's own entries (ids only) where derender named none."""
        entries = generation.logprob_entries
        ends = generation.ends_on_end_id
        named = len(entries) - (1 if ends else 0)
        if len(derendered) != named or len(entries) != len(generation.token_ids):
            return entries
        if not ends:
            return derendered
        end = entries[-1]
        try:
            alternatives = [{"token": await self.token_text(top["token_id"], model), "logprob": top.get("logprob")}
                            for top in end.get("top_logprobs") or ()]
            token = await self.token_text(end["token_id"], model)
        except (ProxyError, KeyError, TypeError):
            return [*derendered, end]  # named as ids (see proxy.apis.openai_chat): the turn itself is fine
        return [*derendered, {"token": token, "logprob": end.get("logprob"), "bytes": list(token.encode("utf-8")),
                              "top_logprobs": [{**top, "bytes": list(top["token"].encode("utf-8"))}
                                               for top in alternatives]}]

    async def token_text(self, token_id: int, model: str) -> str:
        """The text of one token id (an end-of-sequence token's name, ``<|im_end|>``), asked of the engine once
        and remembered (at most :data:`_TOKEN_TEXTS` ids)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = await self.detokenize([token_id], model)
            if len(self._token_texts) < _TOKEN_TEXTS:
                self._token_texts[token_id] = text
        return text

    async def tokenize(self, text: str, model: str) -> list[int]:
        """The ids of plain ``text`` (no special tokens added)."""
        document = await self._post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
        ids = document.get("tokens")
        if not isinstance(ids, list):
            raise EngineFailed("engine tokenize reply has no tokens")
        return ids

    async def detokenize(self, token_ids: list[int], model: str) -> str:
        document = await self._post("/detokenize", {"model": model, "tokens": token_ids})
        text = document.get("prompt")
        if not isinstance(text, str):
            raise EngineFailed("engine detokenize reply has no prompt text")
        return text
