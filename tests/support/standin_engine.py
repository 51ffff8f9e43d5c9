"""A stand-in for vLLM's OpenAI server, for fast tests and benchmarks (no model, fixed latency).

Its replies have the shapes recorded from the real vLLM CPU server (``tests/fixtures/vllm/``): the
whole reply and every stream chunk are built from a recorded template, with only ids, text, token ids
and logprobs filled in. "Tokenization" is one token per UTF-8 byte of a ChatML rendering of the
messages, so a later turn's prompt extends an earlier turn's prompt by prefix, as with a real template
(the text and token model, shared with the token endpoints, is ``tests/support/standin_text.py``).

Like the real server it honours ``structured_outputs.regex`` holding a literal (that is how tests force
a tool call): the reply is that text, and a ``<tool_call>{json}</tool_call>`` reply comes back as
``tool_calls`` when tools were offered. A turn forced by token ids for the real engine
(``vllm_xargs.rollwire_forced_tokens``, see ``deploy/engine/plugins``) carries its text as
``vllm_xargs.rollwire_forced_text``: the reply is that text, tokenized the stand-in's way (the real ids
mean nothing under its one-token-per-byte scheme); without the text, the ids themselves come back, the
text being those below 256 read as bytes.

A request the stand-in cannot read (a body that is not a chat completion it understands) gets vLLM's
400 ``BadRequestError`` object, as the real server answers malformed input, never a 500.

Failure modes are chosen per request with the ``x-standin-fail`` header or the ``standin_fail`` body
field. The proxy does not forward harness headers, but it does put a session's ``engine.extra`` into
every engine body, so a session created with ``{"engine": {"extra": {"standin_fail": "no_finish"}}}``
gets that mode on each of its calls. "Midway" below is after half of the reply's token chunks (so a
reply of two or more chunks has sent some tokens first). The modes, shaped as vLLM's server sends them:

- ``overflow``: vLLM's context-length 400 (``BadRequestError``).
- ``error``: a 500 with vLLM's error object.
- ``hang``: no answer at all (the caller's timeout decides).
- ``cut``: the stream breaks off midway (the connection closes without a proper chunked end).
- ``error_string``: streamed, the normal chunks up to midway, then ``data: {"error": "engine exploded"}``
  (the error a plain string) and the body ends; whole, a 500 with that same body.
- ``error_object``: the same with vLLM's error object, ``data: {"error": {"message": ..., "type":
  "InternalServerError", "param": null, "code": 500}}``; whole, a 500 with it.
- ``no_finish``: streamed, every token chunk with ``finish_reason: null``, then the body ends cleanly
  with no finish chunk, no usage chunk and no ``data: [DONE]``; whole, a reply whose choice has
  ``finish_reason: null``.
- ``garbage``: streamed, midway a chunk whose data is not JSON (the stream then goes on to its normal
  end); whole, a 200 ``application/json`` body that is not JSON.
- ``no_token_ids``: the reply, whole or streamed, without ``prompt_token_ids`` and ``token_ids`` (a
  vLLM started without ``return_token_ids`` support).

With ``dev_mode`` (``--dev-mode``; vLLM registers these only with ``VLLM_SERVER_DEV_MODE=1``) it also
serves vLLM's weight-update endpoints, with the shapes recorded in ``tests/fixtures/vllm/weights_*.json``,
so the proxy's weight sync (``POST /v1/policy/weights``) and a learning loop run against it:

- ``GET /weight_info`` → ``{"weight_version": "default"}`` until ``POST /update_weight_version
  {"new_version": V}`` sets ``V``; generate's ``weight_versions`` spans name the version (a generate
  during which the version changed reports two spans, split in the middle);
- ``POST /pause`` (any ``mode``): new chat and generate requests wait until ``POST /resume``; requests
  already running finish on their own; ``GET /is_paused``;
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": P}}``: records ``P`` in
  ``Standin.loaded_paths`` and sleeps ``reload_ms`` (no weights change: the stand-in has none). As vLLM
  does, it fails (HTTP 500, vLLM's error object) when ``P`` is neither an existing folder nor the
  stand-in's own ``root`` (its model name, on ``/v1/models``) or is in ``Standin.unmounted`` (a host that
  cannot see it), and then, as vLLM 0.32's half-loaded model does, fails every chat and generate request
  (500) until a reload succeeds; any other method fails; with ``unhealthy_while_reloading``, ``/health``
  answers 503 while the load runs (an engine core too busy to answer its health check);
- ``POST /reset_prefix_cache`` → ``{"success": true}`` (counted in ``Standin.prefix_cache_resets``).

Without ``dev_mode`` these paths are 404, as on vLLM without dev mode.

    python -m tests.support.standin_engine --port 18001 --latency-ms 20 [--token-api] [--dev-mode --reload-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import copy
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# The forced-turn arguments are re-exported: tests and harnesses force turns through this module.
from tests.support.standin_text import FORCED_TEXT_ARG as FORCED_TEXT_ARG
from tests.support.standin_text import FORCED_TOKENS_ARG as FORCED_TOKENS_ARG
from tests.support.standin_text import (
    forced_xargs,
    load_fixture,
    logprob,
    render_prompt,
    reply_text,
    tokenize,
    tool_calls,
    top_alternatives,
)
from tests.support.standin_tokens import TokenEndpoints

FAIL_MODES = ("overflow", "error", "hang", "cut", "error_string", "error_object", "no_finish", "garbage",
              "no_token_ids")
STREAM_ERROR_STRING = "engine exploded"
_GARBAGE = b"data: {this is not json <html>502 Bad Gateway</html>\n\n"


@dataclass
class StandinConfig:
    model: str = "rollwire-tiny"
    latency_ms: float = 20.0
    reply_tokens: int = 24
    token_interval_ms: float = 0.0
    max_model_len: int = 262_144
    chunk_tokens: int = 1
    bytes_per_token: int = 1
    token_api: bool = False  # serve vLLM's token endpoints (standin_tokens.py), as --enable-scale-out does
    dev_mode: bool = False  # serve vLLM's weight-update endpoints, as VLLM_SERVER_DEV_MODE=1 does
    reload_ms: float = 50.0  # how long reload_weights takes
    unhealthy_while_reloading: bool = False  # /health answers 503 during reload_weights (an engine core busy)


class Standin:
    """The stand-in server's state and handlers."""

    def __init__(self, config: StandinConfig) -> None:
        self.config = config
        self.whole_template = load_fixture("chat_whole.json")["response"]
        self.tool_message_template = load_fixture("tool_call_whole.json")["response"]["choices"][0]["message"]
        stream = load_fixture("chat_stream.json")["chunks"]
        self.first_chunk, self.middle_chunk = stream[0], stream[1]
        self.final_chunk = next(c for c in stream if c["choices"] and c["choices"][0].get("finish_reason"))
        self.usage_chunk = next(c for c in stream if not c["choices"])
        self.error_template = load_fixture("error_context_overflow.json")["response"]
        self.requests = 0
        self.weight_version = "default"  # vLLM's name for the weights it started with
        self.loaded_paths: list[str] = []
        self.prefix_cache_resets = 0
        self._running: asyncio.Event | None = None  # cleared while paused (made on the server's loop)
        self.broken = False  # a failed reload_weights: every request fails until a good reload
        self.reloading = False
        self.unmounted: set[str] = set()  # checkpoint folders this engine's host cannot see

    def broken_reply(self) -> JSONResponse | None:
        """vLLM's answer once its engine core died (a forward pass over half-loaded weights), else None."""
        return self.error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.") \
            if self.broken else None

    async def until_running(self) -> None:
        """Wait while the engine is paused (a weight update); at once otherwise."""
        if self._running is not None and not self._running.is_set():
            await self._running.wait()

    def error(self, status: int, message: str, param: str | None = None) -> JSONResponse:
        """vLLM's error object: ``BadRequestError`` for a 4xx, ``InternalServerError`` for a 5xx."""
        body = copy.deepcopy(self.error_template)
        body["error"].update(message=message, code=status, param=param,
                             type="BadRequestError" if status < 500 else "InternalServerError")
        return JSONResponse(body, status_code=status)

    async def models(self, request: Request) -> JSONResponse:
        # vLLM's root is the folder (or hub id) it loaded: the stand-in's is its model name.
        return JSONResponse({"object": "list", "data": [{"id": self.config.model, "object": "model",
                                                          "owned_by": "vllm", "root": self.config.model, "parent": None,
                                                          "max_model_len": self.config.max_model_len}]})

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.reloading and self.config.unhealthy_while_reloading else 200)

    async def tokenize(self, request: Request) -> JSONResponse:
        try:
            body = await request.json()
            ids = tokenize(render_prompt(body) if "messages" in body else body.get("prompt", ""))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return self.error(400, f"invalid tokenize request: {exc}"[:2000])
        return JSONResponse({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def chat(self, request: Request) -> Response:
        self.requests += 1
        await self.until_running()
        if (broken := self.broken_reply()) is not None:
            return broken
        try:
            body = orjson.loads(await request.body())
            fail = request.headers.get("x-standin-fail") or body.get("standin_fail")
            max_tokens = body.get("max_tokens") or self.config.reply_tokens
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
            prompt = render_prompt(body)
            # One token per byte: a prompt over the context is refused before it is tokenized (fuzzed bodies
            # carry prompts of many MiB).
            size = len(prompt.encode("utf-8")) if self.config.bytes_per_token == 1 else None
            prompt_ids = [] if size is not None and size > self.config.max_model_len else \
                tokenize(prompt, self.config.bytes_per_token)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            # vLLM validates the body and answers what it cannot read with a 400, never a 500.
            return self.error(400, f"invalid chat completion request: {exc}"[:2000])
        except RecursionError as exc:  # JSON text nested past Python's limit (e.g. tool-call arguments)
            return self.error(500, f"the engine failed to render the prompt: {exc}")
        prompt_len = size if size is not None else len(prompt_ids)
        context = self.config.max_model_len
        # As vLLM 0.32: a prompt that fills the context is refused (parameter input_tokens); a max_tokens over
        # the whole context is refused; one that does not fit beside the prompt is clamped to what is left
        # (vllm/entrypoints/serve/utils/api_utils.py get_max_tokens), not refused.
        if fail == "overflow" or prompt_len >= context:
            message = (f"This model's maximum context length is {context} tokens. However, your prompt contains "
                       f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. "
                       f"Please reduce the length of the input prompt. (parameter=input_tokens, value={prompt_len})")
            return self.error(400, message, "input_tokens")
        if max_tokens > context:
            message = (f"max_tokens={max_tokens} cannot be greater than max_model_len={context}. Please request "
                       f"fewer output tokens. (parameter=max_tokens, value={max_tokens})")
            return self.error(400, message, "max_tokens")
        max_tokens = min(max_tokens, context - prompt_len)
        if fail == "error" or (fail == "error_object" and not body.get("stream")):
            return self.error(500, "EngineCore encountered an issue.")
        if fail == "error_string" and not body.get("stream"):
            return JSONResponse({"error": STREAM_ERROR_STRING}, status_code=500)
        if fail == "garbage" and not body.get("stream"):
            return Response(b"<html>502 Bad Gateway</html>", media_type="application/json")
        if fail == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(self.config.latency_ms / 1000)
        text = reply_text(body, prompt_ids, min(max_tokens, self.config.reply_tokens))
        forced_text, forced_ids = forced_xargs(body)
        forced = bool(body.get("structured_outputs")) or forced_text is not None or forced_ids is not None
        if forced_text is None and forced_ids is not None:
            ids, full = forced_ids[:max_tokens], len(forced_ids)
        else:
            ids = tokenize(text)[:min(max_tokens, max(self.config.reply_tokens, len(text) if forced else 0))]
            text = bytes(ids).decode("utf-8", errors="ignore")
            full = len(tokenize(reply_text(body, prompt_ids, self.config.reply_tokens)))
        finish = "length" if full > max_tokens else "stop"
        calls = tool_calls(text, body) if finish == "stop" else []
        if calls:
            finish = "tool_calls"
        if body.get("stream"):
            return StreamingResponse(self._stream(body, prompt_ids, ids, text, calls, finish, fail),
                                     media_type="text/event-stream")
        if self.config.token_interval_ms:  # a whole reply comes once all its tokens are sampled
            await asyncio.sleep(len(ids) * self.config.token_interval_ms / 1000)
        response = copy.deepcopy(self.whole_template)
        response.update(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=body.get("model"),
                        prompt_token_ids=prompt_ids)
        choice = response["choices"][0]
        if calls:
            choice["message"] = {**copy.deepcopy(self.tool_message_template), "tool_calls": calls}
        else:
            choice["message"]["content"] = text
        choice["finish_reason"] = None if fail == "no_finish" else finish
        choice["token_ids"] = ids
        top = int(body.get("top_logprobs") or 0)
        choice["logprobs"] = {"content": [self._logprob_entry(t, i, top) for i, t in enumerate(ids)]}
        response["usage"].update(prompt_tokens=len(prompt_ids), completion_tokens=len(ids),
                                 total_tokens=len(prompt_ids) + len(ids))
        if fail == "no_token_ids":
            response.pop("prompt_token_ids", None)
            choice.pop("token_ids", None)
        return JSONResponse(response)

    @staticmethod
    def _token_logprob(token: int, position: int) -> dict[str, Any]:
        raw = [token] if 0 <= token < 256 else []  # forced real-vocabulary ids have no byte here
        return {"token": bytes(raw).decode("utf-8", errors="replace"), "logprob": logprob(token, position),
                "bytes": raw}

    def _logprob_entry(self, token: int, position: int, top: int = 0) -> dict[str, Any]:
        """vLLM's entry for a sampled token; with ``top`` (the request's ``top_logprobs``), that many
        alternatives, most likely first (the sampled token among them, as vLLM lists it when it is)."""
        alternatives = [self._token_logprob(t, position) for t in top_alternatives(token, position, top)]
        return {**self._token_logprob(token, position), "top_logprobs": alternatives}

    async def _stream(self, body: dict[str, Any], prompt_ids: list[int], ids: list[int], text: str,
                      calls: list[dict[str, Any]], finish: str, fail: str | None) -> AsyncIterator[bytes]:
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.get("model")
        token_ids = fail != "no_token_ids"

        def chunk(template: dict[str, Any], **choice: Any) -> bytes:
            out = {**template, "id": rid, "created": created, "model": model}
            if out.get("choices"):
                out["choices"] = [{**out["choices"][0], **choice}]
                if not token_ids:
                    out["choices"][0].pop("token_ids", None)
            return b"data: " + orjson.dumps(out) + b"\n\n"

        top = int(body.get("top_logprobs") or 0)
        first = {**self.first_chunk, "prompt_token_ids": prompt_ids}
        if not token_ids:
            first.pop("prompt_token_ids")
        yield chunk(first)
        step = max(1, self.config.chunk_tokens)
        pieces = [ids[i:i + step] for i in range(0, len(ids), step)]
        deltas = self._tool_call_deltas(calls, len(pieces)) if calls else None
        # Like vLLM's incremental detokenizer: a character split across tokens is held back until whole
        # (its first tokens carry empty text), never sent as pieces that decode to nothing or to U+FFFD.
        text_of = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Token n leaves at ``paced_from + n * interval``: an engine samples at its own pace (its GPU's decode
        # steps), so a wake-up this process was late for (its loop busy, or the cores taken by whoever shares
        # this machine) is caught up on, not added to every later token.
        paced_from = asyncio.get_running_loop().time()
        for n, piece in enumerate(pieces):
            if self.config.token_interval_ms and n:
                due = paced_from + n * self.config.token_interval_ms / 1000 - asyncio.get_running_loop().time()
                if due > 0:
                    await asyncio.sleep(due)
            if n == len(pieces) // 2:
                if fail == "cut":
                    raise ConnectionError("stand-in cut the stream")
                if fail == "error_string":
                    yield b"data: " + orjson.dumps({"error": STREAM_ERROR_STRING}) + b"\n\n"
                    return
                if fail == "error_object":
                    yield b"data: " + orjson.dumps({"error": {
                        "message": "EngineCore encountered an issue. See stack trace for the root cause.",
                        "type": "InternalServerError", "param": None, "code": 500}}) + b"\n\n"
                    return
                if fail == "garbage":
                    yield _GARBAGE
            last = n == len(pieces) - 1 and fail != "no_finish"
            template = self.final_chunk if last else self.middle_chunk
            lps = {"content": [self._logprob_entry(t, n * step + j, top) for j, t in enumerate(piece)]}
            if deltas is not None:
                delta = deltas[n]
            else:
                raw = bytes(t for t in piece if 0 <= t < 256)
                delta = {"content": text_of.decode(raw, final=n == len(pieces) - 1)}
            yield chunk(template, delta=delta, token_ids=piece, logprobs=lps, finish_reason=finish if last else None)
        if fail == "no_finish":
            return  # the body ends cleanly: no finish chunk, no usage, no [DONE]
        usage = {**self.usage_chunk, "usage": {**self.usage_chunk["usage"], "prompt_tokens": len(prompt_ids),
                                               "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)}}
        yield chunk(usage)
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _tool_call_deltas(calls: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
        """Per-token deltas shaped like vLLM's hermes parser output: silent tokens ({}), one delta with
        the call's id and name, then the arguments in pieces, and {} on the closing token."""
        deltas: list[dict[str, Any]] = [{} for _ in range(n)]
        slots = list(range(1, max(1, n - 1)))
        per_call = max(1, len(slots) // max(1, len(calls)))
        for i, call in enumerate(calls):
            mine = slots[i * per_call:(i + 1) * per_call] or [min(n - 1, i)]
            head = {"id": call["id"], "type": "function", "index": i, "function": {"name": call["function"]["name"]}}
            deltas[mine[0]] = {"content": None, "tool_calls": [head]}
            arguments, rest = call["function"]["arguments"], mine[1:] or [mine[0]]
            size = -(-len(arguments) // len(rest))
            for j, slot in enumerate(rest):
                part = arguments[j * size:(j + 1) * size]
                if part:
                    entry = {"index": i, "function": {"arguments": part}}
                    existing = deltas[slot].get("tool_calls")
                    deltas[slot] = {"content": None, "tool_calls": (existing or []) + [entry]}
        return deltas

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self.models), Route("/health", self.health),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ]
        if self.config.token_api:
            routes += TokenEndpoints(self).routes()
        if self.config.dev_mode:
            routes += WeightEndpoints(self).routes()
        return Starlette(routes=routes)


class WeightEndpoints:
    """vLLM's weight-update endpoints on a stand-in (see the module docstring), replies as recorded."""

    def __init__(self, standin: Standin) -> None:
        self.standin = standin
        self.replies = {name: load_fixture(f"weights_{name}.json")["response"]
                        for name in ("pause", "resume", "reload", "update_version", "reset_prefix_cache")}
        self.reload_error = load_fixture("weights_reload_missing.json")["response"]

    def _running(self) -> asyncio.Event:
        if self.standin._running is None:
            self.standin._running = asyncio.Event()
            self.standin._running.set()
        return self.standin._running

    async def weight_info(self, request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": self.standin.weight_version})

    async def is_paused(self, request: Request) -> JSONResponse:
        return JSONResponse({"is_paused": not self._running().is_set()})

    async def pause(self, request: Request) -> JSONResponse:
        self._running().clear()
        return JSONResponse(self.replies["pause"])

    async def resume(self, request: Request) -> JSONResponse:
        self._running().set()
        return JSONResponse(self.replies["resume"])

    async def update_weight_version(self, request: Request) -> JSONResponse:
        try:
            version = (await request.json())["new_version"]
        except (ValueError, KeyError, TypeError) as exc:
            return self.standin.error(400, f"update_weight_version needs a JSON body with new_version: {exc!r}")
        self.standin.weight_version = str(version)
        return JSONResponse({**self.replies["update_version"], "new_version": str(version)})

    async def collective_rpc(self, request: Request) -> JSONResponse:
        try:
            body = await request.json()
            method, path = body["method"], (body.get("kwargs") or {}).get("weights_path")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return self.standin.error(400, f"collective_rpc needs a JSON body with a method: {exc!r}")
        if method != "reload_weights":
            return self._failed(f"the stand-in runs only reload_weights, not {method!r}")
        self.standin.reloading = True
        try:
            await asyncio.sleep(self.standin.config.reload_ms / 1000)
        finally:
            self.standin.reloading = False
        if path is not None and path != self.standin.config.model and (not os.path.isdir(path)
                                                                       or path in self.standin.unmounted):
            self.standin.broken = True  # as vLLM 0.32: the model is left half-loaded
            return self._failed(f"Call to collective_rpc method failed: Worker failed with error '{path} is not "
                                "a folder the engine can read', please check the stack trace above for the root cause")
        self.standin.broken = False
        self.standin.loaded_paths.append(path or self.standin.config.model)
        return JSONResponse(self.replies["reload"])

    def _failed(self, message: str) -> JSONResponse:
        """vLLM's answer when a worker raises in collective_rpc (its error object, HTTP 500)."""
        body = copy.deepcopy(self.reload_error)
        body["error"]["message"] = message
        return JSONResponse(body, status_code=500)

    async def reset_prefix_cache(self, request: Request) -> JSONResponse:
        self.standin.prefix_cache_resets += 1
        return JSONResponse(self.replies["reset_prefix_cache"])

    def routes(self) -> list[Route]:
        return [Route("/weight_info", self.weight_info), Route("/is_paused", self.is_paused),
                Route("/pause", self.pause, methods=["POST"]), Route("/resume", self.resume, methods=["POST"]),
                Route("/update_weight_version", self.update_weight_version, methods=["POST"]),
                Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"])]


def create_app(config: StandinConfig | None = None) -> Starlette:
    return Standin(config or StandinConfig()).app()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Stand-in vLLM server with recorded shapes.")
    parser.add_argument("--port", type=int, default=18001)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--chunk-tokens", type=int, default=1)
    parser.add_argument("--bytes-per-token", type=int, default=1)
    parser.add_argument("--token-interval-ms", type=float, default=0.0)
    parser.add_argument("--token-api", action="store_true", help="serve the token endpoints (exact continuation)")
    parser.add_argument("--dev-mode", action="store_true", help="serve the weight-update endpoints (weight sync)")
    parser.add_argument("--reload-ms", type=float, default=50.0, help="how long reload_weights takes")
    args = parser.parse_args()
    config = StandinConfig(latency_ms=args.latency_ms, reply_tokens=args.reply_tokens,
                           chunk_tokens=args.chunk_tokens, bytes_per_token=args.bytes_per_token,
                           token_interval_ms=args.token_interval_ms, token_api=args.token_api,
                           dev_mode=args.dev_mode, reload_ms=args.reload_ms)
    uvicorn.run(create_app(config), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
