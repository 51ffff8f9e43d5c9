"""The stand-in engine's token endpoints: render, generate, derender, detokenize, with vLLM's recorded shapes.

What vLLM serves under ``--enable-scale-out`` (``tests/fixtures/vllm/render.json``, ``generate.json``,
``derender.json``, ``detokenize.json``), so the proxy's exact-token continuation runs against the
stand-in in fast tests and benchmarks. Tokens on this path are the stand-in's bytes, except that the
template's two markers are special tokens with the real vocabulary's ids (``<|im_start|>`` 151644,
``<|im_end|>`` 151645), as in the real model: a turn that stops samples ``<|im_end|>`` as its last id,
and a closed turn is followed by the template's ``\\n``. The prompt layout is the stand-in's ChatML
(``standin_text.render_prompt``), which appends the generation prompt only when asked.

- render: the chat request's prompt ids and vLLM-shaped ``sampling_params`` (``vllm_xargs`` as
  ``extra_args``, ``structured_outputs``, the stand-in's ``standin_fail`` carried there too);
- generate: the reply the chat endpoint would give for the same request (forced text or ids, a literal
  regex, or seeded words), for the given ids, with the stand-in's weight version spans;
  ``standin_fail``: ``overflow``, ``error``, ``hang``;
- derender: the generate reply's ids read back as text, tool calls parsed when the request offered tools.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support import standin_text as text_model

IM_START, IM_END = 151644, 151645
_MARKERS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
_NAMES = {v: k for k, v in _MARKERS.items()}


class StandinSettings(Protocol):
    """The stand-in's settings the token endpoints read (``standin_engine.StandinConfig``)."""

    latency_ms: float
    reply_tokens: int
    token_interval_ms: float
    max_model_len: int
    bytes_per_token: int


class StandinHost(Protocol):
    """What the token endpoints need from the stand-in that serves them (``standin_engine.Standin``): its
    settings, its request counter, and vLLM's error response."""

    requests: int
    weight_version: str

    @property
    def config(self) -> StandinSettings: ...

    async def until_running(self) -> None: ...

    def error(self, status: int, message: str, param: str | None = None) -> Response: ...

    def broken_reply(self) -> Response | None: ...


def tokenize_chat(text: str, bytes_per_token: int = 1) -> list[int]:
    """The stand-in's tokens (``standin_text.tokenize``), with the template's markers as their special ids."""
    ids: list[int] = []
    rest = text
    while rest:
        cut = min(((rest.find(m), m) for m in _MARKERS if rest.find(m) >= 0), default=None)
        if cut is None:
            ids.extend(text_model.tokenize(rest, bytes_per_token))
            break
        at, marker = cut
        if at:
            ids.extend(text_model.tokenize(rest[:at], bytes_per_token))
        ids.append(_MARKERS[marker])
        rest = rest[at + len(marker):]
    return ids


def detokenize_chat(ids: list[int]) -> str:
    out, run = [], bytearray()
    for token in ids:
        if token in _NAMES:
            out.append(run.decode("utf-8", errors="ignore"))
            run.clear()
            out.append(_NAMES[token])
        elif 0 <= token < 256:
            run.append(token)
    out.append(run.decode("utf-8", errors="ignore"))
    return "".join(out)


def _prompt(body: dict[str, Any]) -> str:
    text = text_model.render_prompt(body)
    if body.get("add_generation_prompt", True) is False:
        text = text[: -len("<|im_start|>assistant\n")]
    return text


def _spans(first: str, last: str, tokens: int) -> list[dict[str, Any]]:
    """vLLM's weight version spans: one, or two split in the middle when the version changed meanwhile."""
    if first == last:
        return [{"version": first, "start": 0, "end": tokens}]
    middle = tokens // 2
    return [{"version": first, "start": 0, "end": middle}, {"version": last, "start": middle, "end": tokens}]


class TokenEndpoints:
    """Handlers bound to one stand-in."""

    def __init__(self, standin: StandinHost) -> None:
        self.standin = standin
        self.render_template = text_model.load_fixture("render.json")["response"]
        self.generate_template = text_model.load_fixture("generate.json")["response"]
        self.derender_template = text_model.load_fixture("derender.json")["response"]

    async def render(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            ids = tokenize_chat(_prompt(body), self.standin.config.bytes_per_token)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return self.standin.error(400, f"invalid render request: {exc}"[:2000])
        out = copy.deepcopy(self.render_template)
        sampling = out["sampling_params"]
        sampling.update(seed=body.get("seed"), max_tokens=body.get("max_tokens") or self.standin.config.reply_tokens,
                        temperature=body.get("temperature", 1.0))
        if body.get("top_logprobs"):  # vLLM's SamplingParams.logprobs: alternatives per sampled token
            sampling["logprobs"] = int(body["top_logprobs"])
        extra = dict(body.get("vllm_xargs") or {})
        if body.get("standin_fail"):
            extra["standin_fail"] = body["standin_fail"]
        if extra:
            sampling["extra_args"] = extra
        if body.get("structured_outputs"):
            sampling["structured_outputs"] = body["structured_outputs"]
        out.update(request_id=f"chatcmpl-{uuid.uuid4().hex[:16]}", token_ids=ids, model=body.get("model"))
        return JSONResponse(out)

    async def generate(self, request: Request) -> Response:
        self.standin.requests += 1
        await self.standin.until_running()
        if (broken := self.standin.broken_reply()) is not None:
            return broken
        version_at_start = self.standin.weight_version
        try:
            body = orjson.loads(await request.body())
            prompt: list[int] = list(body["token_ids"])
            sampling = body.get("sampling_params") or {}
            max_tokens = int(sampling.get("max_tokens") or self.standin.config.reply_tokens)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return self.standin.error(400, f"invalid generate request: {exc}"[:2000])
        extra = dict(sampling.get("extra_args") or {})
        fail = extra.pop("standin_fail", None)
        if fail == "overflow" or len(prompt) + max_tokens > self.standin.config.max_model_len:
            return self.standin.error(400, f"This model's maximum context length is "
                                           f"{self.standin.config.max_model_len} tokens. However, your request has "
                                           f"{len(prompt) + max_tokens} input tokens.", "input_tokens")
        if fail == "error":
            return self.standin.error(500, "EngineCore encountered an issue.")
        if fail == "hang":
            await asyncio.sleep(3600)
        chat_like = {"vllm_xargs": extra, "structured_outputs": sampling.get("structured_outputs"),
                     "seed": sampling.get("seed")}
        text = text_model.reply_text(chat_like, prompt, min(max_tokens, self.standin.config.reply_tokens))
        forced = bool(chat_like["structured_outputs"]) or bool(extra)
        ids = list(text.encode("utf-8"))
        limit = min(max_tokens, max(self.standin.config.reply_tokens, len(ids) if forced else 0))
        finish = "length" if len(ids) > limit else "stop"
        ids = ids[:limit] + ([IM_END] if finish == "stop" else [])
        # As long as the chat endpoint takes to stream the same reply: first token, then one per interval.
        config = self.standin.config
        await asyncio.sleep((config.latency_ms + config.token_interval_ms * max(0, len(ids) - 1)) / 1000)
        out = copy.deepcopy(self.generate_template)
        choice = out["choices"][0]
        choice.update(token_ids=ids, finish_reason=finish, stop_reason=None,
                      weight_versions=_spans(version_at_start, self.standin.weight_version, len(ids)),
                      logprobs={"content": [_generated_logprob(t, i, int(sampling.get("logprobs") or 0))
                                            for i, t in enumerate(ids)]})
        out.update(request_id=f"generate-tokens-{uuid.uuid4().hex[:16]}", created=int(time.time()),
                   model=body.get("model"))
        out["usage"].update(prompt_tokens=len(prompt), completion_tokens=len(ids), total_tokens=len(prompt) + len(ids))
        return JSONResponse(out)

    async def derender(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            generated = body["generate_response"]["choices"][0]
            chat = body.get("chat_request") or {}
            ids = [t for t in generated.get("token_ids") or () if t not in _NAMES]
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
            return self.standin.error(400, f"invalid derender request: {exc}"[:2000])
        text = bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="ignore")
        calls = text_model.tool_calls(text, chat)
        out = copy.deepcopy(self.derender_template)
        choice = out["choices"][0]
        choice["message"].update(content=None if calls else text, tool_calls=calls)
        choice["finish_reason"] = generated.get("finish_reason") or "stop"
        # As vLLM's derender: with the chat request's logprobs, generate's entries named (strings, bytes).
        content = (generated.get("logprobs") or {}).get("content") if chat.get("logprobs") else None
        choice["logprobs"] = {"content": [_named(entry) for entry in content]} if content else None
        out.update(id=body["generate_response"].get("request_id") or f"chatcmpl-{uuid.uuid4().hex}",
                   created=int(time.time()), model=chat.get("model"))
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            text = detokenize_chat(list(body["tokens"]))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return self.standin.error(400, f"invalid detokenize request: {exc}"[:2000])
        return JSONResponse({"prompt": text})

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions/render", self.render, methods=["POST"]),
                Route("/inference/v1/generate", self.generate, methods=["POST"]),
                Route("/v1/chat/completions/derender", self.derender, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]


def _generated_logprob(token: int, position: int, top: int) -> dict[str, Any]:
    """generate's entry for a sampled token (ids and ranks, no strings); with ``top`` (the sampling
    params' ``logprobs``) its alternatives, the sampled id first, as vLLM 0.32 lists them."""
    alternatives = text_model.top_alternatives(token, position, top)
    return {"token_id": token, "logprob": text_model.logprob(token, position), "rank": 1,
            "top_logprobs": [{"token_id": t, "logprob": text_model.logprob(t, position), "rank": rank + 1}
                             for rank, t in enumerate(alternatives)]}


def _named(entry: dict[str, Any]) -> dict[str, Any]:
    """A generate logprob entry as derender gives it back: token string and bytes, alternatives too."""
    def one(token: int, value: float) -> dict[str, Any]:
        name = _NAMES.get(token)
        raw = list(name.encode("utf-8")) if name else [token] if 0 <= token < 256 else []
        return {"token": name or bytes(raw).decode("utf-8", errors="replace"), "logprob": value, "bytes": raw}

    return {**one(entry["token_id"], entry["logprob"]),
            "top_logprobs": [one(top["token_id"], top["logprob"]) for top in entry.get("top_logprobs") or ()]}
