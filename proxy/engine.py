"""The upstream engine: vLLM's OpenAI server, called with chat completions that return token data.

Every provider API is normalized into one request form and sent here as a chat completion with
``return_token_ids`` and ``logprobs``, the model pinned to the served model. Replies come back as an
:class:`~proxy.turns.EngineTurn` (whole) or a sequence of :class:`~proxy.turns.EngineDelta` (streamed). Streams come in batches (what one socket read held)
through aiohttp; everything else (whole replies, models, tokenize, the token and weight APIs) through
httpx. Both clients' errors become :mod:`proxy.errors` exceptions.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

import aiohttp
import httpx
import orjson

from proxy.errors import (
    BadRequest,
    ContextOverflow,
    EngineConnectionLost,
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    ProxyError,
)
from proxy.settings import ProxySettings
from proxy.turns import EngineDelta, EngineTurn, ToolCallDelta
from schemas.completions import ChatMessage, NormalizedRequest, ToolCall, Usage
from schemas.tasks import EngineParams


def engine_message(message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role}
    if isinstance(message.content, list):
        parts = []
        for part in message.content:
            if part.type != "text":
                raise BadRequest("this engine takes text only: remove image content from the request",
                                 param="messages")
            parts.append({"type": "text", "text": part.text or ""})
        out["content"] = parts
    else:
        out["content"] = message.content
    if message.reasoning:
        out["reasoning"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None and role != "tool":
        out["name"] = message.name
    return out


def effective_request(request: NormalizedRequest, overrides: EngineParams) -> NormalizedRequest:
    """The request with the session's fixed sampling parameters in place of the harness's.

    Engine extras are the session's ``extra``, then the entry of ``turns`` for this turn (the number of
    assistant messages the prompt already holds; the last entry for every later turn), over the harness's.
    """
    fixed = {name: getattr(overrides, name) for name in ("temperature", "top_p", "top_k", "max_tokens", "seed")
             if getattr(overrides, name) is not None}
    extra = overrides.extra
    if overrides.turns:
        done = sum(1 for m in request.messages if m.role == "assistant")
        extra = {**extra, **overrides.turns[min(done, len(overrides.turns) - 1)]}
    if not fixed and not extra:
        return request
    sampling = request.sampling.model_copy(update={**fixed, "extra": {**request.sampling.extra, **extra}})
    return request.model_copy(update={"sampling": sampling})


def fit_max_tokens(request: NormalizedRequest, max_model_len: int | None) -> NormalizedRequest:
    """Harnesses ask for more output tokens than a small engine's whole context (Qwen Code: 32768);
    vLLM refuses that outright, but caps a smaller value to the context the prompt leaves. So a request
    above the context length is capped to it, and the event records the value actually sent."""
    wanted = request.sampling.max_tokens
    if wanted is None or max_model_len is None or wanted <= max_model_len:
        return request
    return request.model_copy(update={"sampling": request.sampling.model_copy(update={"max_tokens": max_model_len})})


def engine_body(request: NormalizedRequest, model: str, *, stream: bool) -> dict[str, Any]:
    """The vLLM chat completion body for a normalized request (overrides already applied)."""
    sampling = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "messages": [engine_message(m) for m in request.messages],
        "stream": stream,
        "return_token_ids": True,
        "logprobs": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.parameters or {"type": "object", "properties": {}}}} for t in request.tools]
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
    values = {
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "max_tokens": sampling.max_tokens, "seed": sampling.seed,
        "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
    }
    body.update({k: v for k, v in values.items() if v is not None})
    if sampling.stop:
        body["stop"] = sampling.stop
    if request.reasoning_effort is not None:
        body["reasoning_effort"] = request.reasoning_effort
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    body.update(sampling.extra)
    return body


def _logprob_entries(logprobs: Any) -> list[dict[str, Any]]:
    """The per-token entries of a choice's ``logprobs`` block (``content``), as the engine sent them."""
    if not logprobs or not logprobs.get("content"):
        return []
    return logprobs["content"]


def _logprob_values(entries: list[dict[str, Any]]) -> list[float | None]:
    return [entry.get("logprob") for entry in entries]


def _usage(raw: Any) -> Usage | None:
    if not raw:
        return None
    details = raw.get("prompt_tokens_details") or {}
    return Usage(prompt_tokens=raw.get("prompt_tokens") or 0, completion_tokens=raw.get("completion_tokens") or 0,
                 cached_tokens=details.get("cached_tokens"))


def parse_chunk(chunk: dict[str, Any]) -> EngineDelta:
    """An :class:`EngineDelta` from one vLLM ``chat.completion.chunk``."""
    delta = EngineDelta(prompt_token_ids=chunk.get("prompt_token_ids"), usage=_usage(chunk.get("usage")))
    for choice in chunk.get("choices") or ():
        message = choice.get("delta") or {}
        delta.content = message.get("content") or None
        delta.reasoning = message.get("reasoning") or message.get("reasoning_content") or None
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            delta.tool_calls.append(ToolCallDelta(index=call.get("index", 0), id=call.get("id"),
                                                  name=function.get("name"), arguments=function.get("arguments") or ""))
        delta.finish_reason = choice.get("finish_reason")
        delta.stop_reason = choice.get("stop_reason")
        delta.token_ids = choice.get("token_ids") or []
        delta.logprob_entries = _logprob_entries(choice.get("logprobs"))
        delta.logprobs = _logprob_values(delta.logprob_entries)
    return delta


def parse_response(body: dict[str, Any]) -> EngineTurn:
    """An :class:`EngineTurn` from a whole vLLM ``chat.completion``."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineFailed(f"engine reply has no choices[0].message: {str(body)[:200]}") from exc
    calls = [ToolCall(id=c.get("id") or f"call_{i}", name=c["function"]["name"],
                      arguments=c["function"].get("arguments") or "")
             for i, c in enumerate(message.get("tool_calls") or ())]
    token_ids = choice.get("token_ids") or []
    entries = _logprob_entries(choice.get("logprobs"))
    return EngineTurn(
        prompt_token_ids=body.get("prompt_token_ids") or [],
        token_ids=token_ids,
        logprobs=_logprob_values(entries),
        logprob_entries=entries,
        content=message.get("content"),
        reasoning=message.get("reasoning") or message.get("reasoning_content"),
        tool_calls=calls,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        usage=_usage(body.get("usage")) or Usage(completion_tokens=len(token_ids)),
        response_id=body.get("id"),
    )


def error_from_response(status: int, text: str) -> ProxyError:
    try:
        detail = json.loads(text)
    except ValueError:
        detail = None
    if isinstance(detail, dict):
        message = _error_text(detail["error"]) if "error" in detail else str(detail.get("message") or text)
    else:
        message = text
    message = str(message)[:2000]
    lowered = message.lower()
    if status == 400 and ("context length" in lowered or "maximum context" in lowered
                          or "too long" in lowered or "max_model_len" in lowered):
        return ContextOverflow(f"the request does not fit the engine's context window: {message}")
    if 400 <= status < 500:
        return BadRequest(f"the engine refused the request: {message}")
    return EngineFailed(f"the engine failed with HTTP {status}: {message}")


_JSON = {"content-type": "application/json"}
# The stream is read as it comes, undecoded (auto_decompress off): ask for it that way.
_STREAM_HEADERS = {**_JSON, "accept-encoding": "identity"}


class VllmEngine:
    """An httpx client for one vLLM OpenAI server; use as an async context manager."""

    def __init__(self, settings: ProxySettings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = settings.engine_url.rstrip("/")
        self._served_model = settings.served_model
        self.max_model_len: int | None = None
        self._models_checked = False
        timeout = httpx.Timeout(settings.engine_timeout_s, connect=settings.engine_connect_timeout_s)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits, transport=transport)
        self._timeout = timeout
        self._transport = transport
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> VllmEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client to the engine (shared with :class:`proxy.continuation.token_api.TokenApi`)."""
        return self._client

    async def served_model(self) -> str:
        """The model name sent upstream: configured, or the first one the engine lists. The first call
        also learns the engine's context length from ``/v1/models`` (vLLM reports ``max_model_len``)."""
        if not self._models_checked:
            try:
                response = await self._client.get("/v1/models")
                response.raise_for_status()
                model = response.json()["data"][0]
                self._served_model = self._served_model or model["id"]
                self.max_model_len = model.get("max_model_len")
                self._models_checked = True
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                if self._served_model is None:
                    if isinstance(exc, httpx.HTTPError):
                        raise translate_http_error(exc) from exc
                    raise EngineFailed(f"engine at {self.url} lists no models") from exc
        assert self._served_model is not None
        return self._served_model

    async def count_prompt_tokens(self, request: NormalizedRequest) -> int:
        """How many tokens the prompt of ``request`` is, by the engine's own tokenizer and chat template
        (vLLM's ``/tokenize`` with the chat messages and tools gives exactly the ids a chat call uses)."""
        model = await self.served_model()
        chat = engine_body(request, model, stream=False)
        body = {key: chat[key] for key in ("model", "messages", "tools", "chat_template_kwargs") if key in chat}
        body["add_generation_prompt"] = True
        try:
            response = await self._client.post("/tokenize", content=orjson.dumps(body), headers=_JSON)
        except httpx.HTTPError as exc:
            raise translate_http_error(exc) from exc
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.text)
        try:
            return int(orjson.loads(response.content)["count"])
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineFailed(f"engine /tokenize reply has no count: {response.text[:200]}") from exc

    async def complete(self, body: dict[str, Any]) -> EngineTurn:
        try:
            response = await self._client.post("/v1/chat/completions", content=orjson.dumps(body),
                                               headers=_JSON)
        except httpx.HTTPError as exc:
            raise translate_http_error(exc) from exc
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.text)
        try:
            document = orjson.loads(response.content)
        except ValueError as exc:
            raise EngineFailed(f"engine reply is not JSON: {response.text[:200]}") from exc
        return _parsed(parse_response, document)

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[list[EngineDelta], None]:
        """The engine's streamed reply as batches of chunks: each batch is what one read from the socket
        held, so that a proxy running behind relays what has piled up in one write instead of one write
        per token. An error chunk (or one that is not JSON) ends it with that error, after the deltas
        before it. Closing the iterator cancels the request (the connection is dropped, which vLLM takes
        as an abort)."""
        async with self._stream_reads(body) as reads:
            lines = SseLines()
            async for data in reads:
                deltas, error = _deltas(lines.feed(data))
                if deltas:
                    yield deltas
                if error is not None:
                    raise error
            deltas, error = _deltas(lines.close())
            if deltas:
                yield deltas
            if error is not None:
                raise error

    def _stream_reads(self, body: dict[str, Any]) -> contextlib.AbstractAsyncContextManager[AsyncIterator[bytes]]:
        """The streamed reply's body, one item a socket read, through aiohttp (less CPU per chunk than
        httpx); an engine transport given to the constructor (tests that rewrite the engine's
        replies) keeps the httpx client. Either client's errors leave as :mod:`proxy.errors` exceptions."""
        return self._httpx_reads(body) if self._transport is not None else self._aiohttp_reads(body)

    @contextlib.asynccontextmanager
    async def _aiohttp_reads(self, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[bytes]]:
        session = self._aiohttp_session()
        try:
            async with session.post(self.url + "/v1/chat/completions", data=orjson.dumps(body),
                                    headers=_STREAM_HEADERS) as response:
                if response.status != 200:
                    raise error_from_response(response.status, (await response.read()).decode(errors="replace"))
                finished = False
                try:
                    yield response.content.iter_any()
                    finished = True
                finally:
                    if not finished:
                        response.close()  # not back to the pool: the engine sees the hang-up and aborts
        except aiohttp.ClientError as exc:
            raise translate_aiohttp_error(exc) from exc
        except TimeoutError as exc:
            raise EngineTimeout(f"the engine did not answer in time: {exc!r}") from exc

    @contextlib.asynccontextmanager
    async def _httpx_reads(self, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[bytes]]:
        try:
            async with self._client.stream("POST", "/v1/chat/completions", content=orjson.dumps(body),
                                           headers=_JSON) as response:
                if response.status_code != 200:
                    raise error_from_response(response.status_code, (await response.aread()).decode(errors="replace"))
                yield response.aiter_bytes()  # content a test transport already read, too
        except httpx.HTTPError as exc:
            raise translate_http_error(exc) from exc

    def _aiohttp_session(self) -> aiohttp.ClientSession:
        """The streaming client, made on first use (an aiohttp session belongs to the running loop)."""
        if self._session is None or self._session.closed:
            # keepalive below uvicorn's 5 s (vLLM's server), so that no request goes out on a connection the
            # engine already closed; sock_read as httpx's read timeout: the longest wait for the next bytes.
            connector = aiohttp.TCPConnector(limit=512, limit_per_host=0, keepalive_timeout=4.0)
            timeout = aiohttp.ClientTimeout(total=None, connect=self._timeout.connect, sock_read=self._timeout.read)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)
        return self._session


class SseLines:
    """Splits a server-sent events byte stream into the payloads of its ``data:`` lines, across reads."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of the lines that ``data`` completes."""
        if self._tail:
            data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def close(self) -> list[bytes]:
        """The payload of a last line the stream ended without a newline after, if any."""
        tail, self._tail = self._tail, b""
        return [tail[5:].strip()] if tail.startswith(b"data:") else []


def _deltas(payloads: list[bytes]) -> tuple[list[EngineDelta], ProxyError | None]:
    """The deltas of a batch of SSE payloads, and the error that stopped it (deltas before it are kept)."""
    deltas: list[EngineDelta] = []
    for payload in payloads:
        if payload == b"[DONE]":
            # Read on to the end of the body so that the connection goes back to the pool.
            continue
        chunk, prompt_text = _chunk_of(payload)
        if chunk is None:
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return deltas, EngineFailed(f"engine sent a chunk that is not JSON: {_shown(payload)}")
        if not isinstance(chunk, dict):
            return deltas, EngineFailed(f"engine sent a chunk that is not a JSON object: {_shown(payload)}")
        if "error" in chunk and "choices" not in chunk:
            return deltas, EngineFailed(f"engine failed mid-stream: {_error_text(chunk['error'])}")
        try:
            delta = _parsed(parse_chunk, chunk)
        except EngineFailed as exc:
            return deltas, exc
        delta.prompt_ids_text = prompt_text
        deltas.append(delta)
    return deltas, None


_PROMPT_IDS_KEY = b'"prompt_token_ids":'


def _chunk_of(payload: bytes) -> tuple[Any, bytes | None]:
    """A chunk that carries the prompt's ids, parsed without them, and their array as the engine wrote it
    (read into ids later, off the path of the chunk's first bytes: :class:`~proxy.turns.TurnAssembler`);
    ``(None, None)`` for any other chunk, or one whose ids are not a plain top-level array, which the
    caller parses whole. The key with its closing quote cannot occur inside a JSON string (a string's
    quotes are escaped), so the first match is a key; that it is the chunk's own is checked after."""
    at = payload.find(_PROMPT_IDS_KEY)
    if at < 0:
        return None, None
    start = at + len(_PROMPT_IDS_KEY)
    while payload[start:start + 1] in (b" ", b"\t", b"\r", b"\n"):
        start += 1
    end = payload.find(b"]", start)
    if payload[start:start + 1] != b"[" or end < 0:
        return None, None
    try:
        chunk = orjson.loads(payload[:start] + b"null" + payload[end + 1:])
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(chunk, dict) or "prompt_token_ids" not in chunk or chunk["prompt_token_ids"] is not None:
        return None, None
    return chunk, payload[start:end + 1]


def _shown(payload: bytes) -> str:
    return payload[:200].decode(errors="replace")


def _error_text(error: Any) -> str:
    """The message of an engine error payload, whatever its shape (vLLM sends an object; others a string)."""
    if isinstance(error, dict):
        error = error.get("message") or error
    return str(error)[:2000]


ParsedT = TypeVar("ParsedT")


def _parsed(parse: Callable[[dict[str, Any]], ParsedT], document: dict[str, Any]) -> ParsedT:
    """``parse(document)``, with an engine reply of the wrong shape (a field of another type) as EngineFailed."""
    try:
        return parse(document)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        raise EngineFailed(f"engine reply has an unexpected shape ({exc!r}): {str(document)[:200]}") from exc


def translate_http_error(exc: httpx.HTTPError) -> ProxyError:
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError):
        return EngineUnavailable(f"the engine cannot be reached: {exc!r}")
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeout(f"the engine did not answer in time: {exc!r}")
    if isinstance(exc, httpx.HTTPStatusError):
        return error_from_response(exc.response.status_code, exc.response.text)
    return EngineConnectionLost(f"the engine connection failed: {exc!r}")


def translate_aiohttp_error(exc: aiohttp.ClientError) -> ProxyError:
    """The streaming client's errors, as :func:`translate_http_error` does httpx's."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return EngineUnavailable(f"the engine cannot be reached: {exc!r}")
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return EngineTimeout(f"the engine did not answer in time: {exc!r}")
    return EngineConnectionLost(f"the engine connection failed: {exc!r}")
