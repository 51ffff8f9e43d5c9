"""Hypothesis strategies of mutated provider requests, seeded from the requests real CLIs sent.

This module owns the generator of the proxy fuzz suite: what a harness (or a broken or hostile client)
could send to the gateway proxy, for all four provider APIs. It knows nothing about the proxy's answers;
:mod:`tests.proxy.fuzz_run` sends the requests and checks them.

Each generated :class:`FuzzRequest` starts from a recorded CLI request (``tests/fixtures/harnesses/``:
Codex on OpenAI Responses, Claude Code on Anthropic Messages, Qwen Code and Pi on Chat Completions, Pi on
Gemini) and applies one to three mutations (:class:`Mutation`): a field dropped, replaced, retyped or
duplicated at a random JSON path; huge, non-ASCII or lone-surrogate strings (written as ``\\ud800``
escapes); JSON nested hundreds to thousands of levels deep where a provider takes free-form JSON (tool
schemas, ``tool_choice``, ``chat_template_kwargs``, response schemas, tool-call arguments, also as a JSON
string inside ``arguments``); damaged reasoning signatures (Anthropic thinking ``signature``, Gemini
``thoughtSignature``, Responses ``encrypted_content``: bad base64, our prefix over garbage, valid encodings
of invalid UTF-8, decompression bombs); unknown roles and types; empty arrays; ``stream`` true, false or
of a wrong type; query parameters the APIs define, with unusual values. Other requests are not a mutated
document at all: bodies that are not JSON, compressed bodies, a wrong content type, a wrong HTTP method,
an unknown path under an API's prefix (trailing slashes included), or a body near or over the 4, 8 and
16 MiB limits (listed explicitly by :func:`large_body_requests`, not drawn).

Every request also says how it authenticates (:class:`AuthMode`): the session's own key on its own
``/s/{id}/`` path, the key alone, another session's key on this session's path, no key, a key no session
has, a path naming no session, or an ended session; and how the key travels (:class:`KeyCarrier`). Some
carry hostile values in the headers the proxy reads besides the key (retry count, lineage hints), and
some are abandoned by the client after the reply's first bytes. Deep JSON is spliced into the serialized
text (:data:`_DEEP`) and huge strings are built in Python, so drawing them costs Hypothesis nothing.
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import json
import re
import zlib
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any, Literal

from hypothesis import strategies as st

HARNESS_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses"
MIB = 1024 * 1024

ApiName = Literal["openai.chat", "openai.responses", "anthropic.messages", "gemini"]
ErrorShape = Literal["openai", "anthropic", "gemini"]
JsonPath = tuple[str | int, ...]

API_ROUTES: dict[str, str] = {
    "openai.chat": "/v1/chat/completions",
    "openai.responses": "/v1/responses",
    "anthropic.messages": "/v1/messages",
    "gemini": "/v1beta/models/gemini-2.5-flash:{method}",
}


class AuthMode(StrEnum):
    """How a request names its session and which key it carries."""

    OWN = "own"              # the session's key on the session's own path: authenticated
    KEY_ONLY = "key_only"    # the session's key on the key-addressed path (no /s/{id}): authenticated
    OTHER = "other"          # another live session's key on this session's path: a cross-session attempt
    NO_KEY = "no_key"        # this session's path and no key at all
    GARBAGE = "garbage"      # a key no session has, on this session's path
    ANONYMOUS = "anonymous"  # no path and a key no session has
    UNKNOWN_PATH = "unknown_path"  # a path naming no session, with a live session's own key
    ENDED = "ended"          # an ended session's own path and key

    @property
    def authenticated(self) -> bool:
        return self in (AuthMode.OWN, AuthMode.KEY_ONLY)

    @property
    def on_session_path(self) -> bool:
        return self not in (AuthMode.KEY_ONLY, AuthMode.ANONYMOUS, AuthMode.UNKNOWN_PATH)


class KeyCarrier(StrEnum):
    """Where the key travels; the proxy takes any of them on any API."""

    BEARER = "bearer"
    X_API_KEY = "x-api-key"
    X_GOOG_API_KEY = "x-goog-api-key"
    QUERY = "query"


@dataclass(frozen=True)
class Seed:
    """One recorded CLI request: the API it was sent on and its body."""

    api: ApiName
    name: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Mutation:
    """One change made to a seed, for reproducers: what, where, and with which value (abbreviated)."""

    op: str
    where: str = ""
    value: str = ""

    def __str__(self) -> str:
        return " ".join(part for part in (self.op, self.where, self.value) if part)


@dataclass(frozen=True)
class FuzzRequest:
    """One HTTP request to send to the proxy, with what the checks need to judge its answer.

    ``route`` is the path under the API root (``/v1/...`` or ``/v1beta/...``); the session part
    (``/s/{id}``) and the key are added at send time from ``session``, ``auth`` and ``carrier``.
    ``records`` is true for a model-call route (POST to a provider endpoint the proxy serves): such a
    call, once authenticated, must leave exactly one completion event. ``stream`` is what the body or
    path asks for, when that is a plain boolean.
    """

    api: ApiName
    seed: str
    method: str
    route: str
    body: bytes
    content_type: str | None = "application/json"
    query: tuple[tuple[str, str], ...] = ()
    chunked: bool = False
    session: int = 0
    auth: AuthMode = AuthMode.OWN
    carrier: KeyCarrier = KeyCarrier.BEARER
    records: bool = True
    stream: bool | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    disconnect: bool = False  # the client closes the connection after the reply's first bytes
    mutations: tuple[Mutation, ...] = field(default_factory=tuple)

    @property
    def error_shape(self) -> ErrorShape:
        return error_shape_of(self.route)

    def describe(self, limit: int = 300) -> str:
        """A one-line reproducer: API, method, route, auth, content type, mutations and a body excerpt."""
        body = self.body[:limit].decode("utf-8", errors="backslashreplace")
        more = f"... ({len(self.body)} bytes)" if len(self.body) > limit else ""
        query = "?" + "&".join(f"{k}={v}" for k, v in self.query) if self.query else ""
        mutations = "; ".join(str(m) for m in self.mutations) or "none"
        headers = "".join(f" {name}={value[:60]!r}" for name, value in self.headers)
        gone = " disconnect=after-first-bytes" if self.disconnect else ""
        return (f"{self.api} {self.method} {self.route}{query} auth={self.auth} carrier={self.carrier} "
                f"content-type={self.content_type!r} chunked={self.chunked}{headers}{gone} seed={self.seed} "
                f"mutations=[{mutations}] body={body!r}{more}")


def error_shape_of(route: str) -> ErrorShape:
    """The provider whose error object a path under an API prefix must answer with."""
    if route.startswith("/v1beta"):
        return "gemini"
    if route == "/v1/messages" or route.startswith("/v1/messages/") or route.startswith("/v1/messages?"):
        return "anthropic"
    return "openai"


# -- seeds ----------------------------------------------------------------------------------------------

_SEED_DIRS: dict[str, ApiName] = {"codex": "openai.responses", "claude-code": "anthropic.messages",
                                  "qwen-code": "openai.chat", "pi": "openai.chat", "pi-gemini": "gemini"}


@cache
def load_seeds() -> tuple[Seed, ...]:
    """Every recorded CLI request, as seeds (the Gemini fixtures are bare bodies, the others wrap one)."""
    seeds = []
    for directory, api in _SEED_DIRS.items():
        for path in sorted((HARNESS_FIXTURES / directory).glob("*.json")):
            document = json.loads(path.read_text())
            body = document["body"] if "body" in document and api != "gemini" else document
            seeds.append(Seed(api, f"{directory}/{path.stem}", body))
    return tuple(seeds)


def seeds_of(api: ApiName) -> tuple[Seed, ...]:
    return tuple(seed for seed in load_seeds() if seed.api == api)


def gemini_route(method: str = "streamGenerateContent") -> str:
    return API_ROUTES["gemini"].format(method=method)


# -- values -------------------------------------------------------------------------------------------

# Spliced into the serialized text: "@@DEEP:<shape>:<depth>@@" (quoted) becomes JSON that deep.
_DEEP = re.compile(rb'"@@DEEP:(obj|list|schema|mixed):(\d+)@@"')
_DEEP_DEPTHS = (65, 300, 1000, 5000, 100_000)


def deep_json(shape: str, depth: int) -> str:
    """JSON text nested ``depth`` levels deep."""
    if shape == "list":
        return "[" * depth + "]" * depth
    if shape == "schema":  # a JSON schema whose properties nest (two JSON levels per schema level)
        levels = max(1, depth // 2)
        return '{"type":"object","properties":{"x":' * levels + '{"type":"string"}' + "}}" * levels
    if shape == "mixed":
        half = depth // 2
        return '{"a":[' * half + "1" + "]}" * half
    return '{"a":' * depth + "1" + "}" * depth


def deep_marker(shape: str, depth: int) -> str:
    return f"@@DEEP:{shape}:{depth}@@"


LONE_SURROGATES = ("\ud800", "x\udfffy", "\udc00\ud800", "\ud83d")  # the last: half an emoji pair
NON_ASCII = ("日本語のテキスト", "🦀🚀 emoji", "e\u0301\u0301\u0301", "\u202eRTL override", "\u0000NUL\u0000",
             "\ufeffBOM", "Ω≈ç√∫", "\U0010ffff", "line\u2028sep\u2029", "ℌ𝔢𝔩𝔩𝔬")

# Values that stand in for anything: wrong types, extremes, empties.
_WRONG_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1.5, -0.0, 2**63, -(2**63) - 1, 2**64 + 7, 10**40, 1e308, "", "x", "null", "1",
    [], {}, [None], [[]], {"": None}, {"type": None}, ["a", 1, None], "日本語", "\ud800",
)


def _abbrev(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} chars)"


# -- JSON paths ---------------------------------------------------------------------------------------

def json_paths(document: Any, prefix: JsonPath = ()) -> list[JsonPath]:
    """Every path below ``document`` (objects by key, arrays by index), parents before children."""
    paths: list[JsonPath] = []
    if isinstance(document, dict):
        for key, value in document.items():
            paths.append((*prefix, key))
            paths.extend(json_paths(value, (*prefix, key)))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            paths.append((*prefix, index))
            paths.extend(json_paths(value, (*prefix, index)))
    return paths


def _get(document: Any, path: JsonPath) -> Any:
    for part in path:
        document = document[part]
    return document


def _show(path: JsonPath) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _set(document: Any, path: JsonPath, value: Any) -> None:
    parent = _get(document, path[:-1])
    parent[path[-1]] = value


def _drop(document: Any, path: JsonPath) -> None:
    parent = _get(document, path[:-1])
    del parent[path[-1]]


# -- semantic places, per API -------------------------------------------------------------------------

_Place = Literal["tool_schema", "tool_choice", "chat_template_kwargs", "response_schema", "tool_args",
                 "tool_args_string"]
PLACES: tuple[_Place, ...] = ("tool_schema", "tool_choice", "chat_template_kwargs", "response_schema",
                              "tool_args", "tool_args_string")


def _list_field(container: dict[str, Any], key: str) -> list[Any]:
    """``container[key]`` as a list to append to (an earlier mutation may have made it something else)."""
    value = container.get(key)
    if not isinstance(value, list):
        value = container[key] = []
    return value


def _dict_field(container: dict[str, Any], key: str, default: dict[str, Any]) -> dict[str, Any]:
    """``container[key]`` as an object to write into (``default`` when it is missing or not an object)."""
    value = container.get(key)
    if not isinstance(value, dict):
        value = container[key] = default
    return value


def _first_dict(items: list[Any], default: dict[str, Any]) -> dict[str, Any]:
    """The first object of ``items``, inserting ``default`` when there is none at the front."""
    if not items or not isinstance(items[0], dict):
        items.insert(0, default)
    return items[0]


def _put_chat(doc: dict[str, Any], place: _Place, value: Any) -> None:
    if place == "tool_schema":
        tool = _first_dict(_list_field(doc, "tools"), {"type": "function", "function": {"name": "probe"}})
        _dict_field(tool, "function", {"name": "probe"})["parameters"] = value
    elif place == "tool_choice":
        doc["tool_choice"] = value
    elif place == "chat_template_kwargs":
        doc["chat_template_kwargs"] = {"enable_thinking": False, "extra": value}
    elif place == "response_schema":
        doc["response_format"] = {"type": "json_schema", "json_schema": {"name": "out", "schema": value}}
    else:
        arguments = value if place == "tool_args" else (value if isinstance(value, str) else json.dumps(value))
        call = {"id": "call_fz", "type": "function", "function": {"name": "bash", "arguments": arguments}}
        _list_field(doc, "messages").extend([
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "ok", "tool_call_id": "call_fz"},
            {"role": "user", "content": "go on"}])


def _put_responses(doc: dict[str, Any], place: _Place, value: Any) -> None:
    if place == "tool_schema":
        tools = _list_field(doc, "tools")
        target = next((t for t in tools if isinstance(t, dict) and t.get("type") == "function"), None)
        if target is None:
            target = {"type": "function", "name": "probe"}
            tools.append(target)
        target["parameters"] = value
    elif place == "tool_choice":
        doc["tool_choice"] = value
    elif place == "chat_template_kwargs":
        doc["chat_template_kwargs"] = {"extra": value}
    elif place == "response_schema":
        doc["text"] = {"format": {"type": "json_schema", "name": "out", "schema": value}}
    else:
        arguments = value if place == "tool_args" else (value if isinstance(value, str) else json.dumps(value))
        items = doc.get("input") if isinstance(doc.get("input"), list) else []
        doc["input"] = [*items,
                        {"type": "function_call", "name": "exec_command", "arguments": arguments, "call_id": "c_fz"},
                        {"type": "function_call_output", "call_id": "c_fz", "output": "ok"}]


def _put_messages(doc: dict[str, Any], place: _Place, value: Any) -> None:
    if place == "tool_schema":
        _first_dict(_list_field(doc, "tools"), {"name": "probe"})["input_schema"] = value
    elif place == "tool_choice":
        doc["tool_choice"] = value
    elif place == "chat_template_kwargs":
        doc["chat_template_kwargs"] = {"extra": value}
    elif place == "response_schema":
        doc["output_config"] = {"format": {"type": "json_schema", "schema": value}}
    else:
        arguments = value if place == "tool_args" else (value if isinstance(value, str) else json.dumps(value))
        _list_field(doc, "messages").extend([
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_fz", "name": "Bash",
                                               "input": arguments}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_fz", "content": "ok"}]}])


def _put_gemini(doc: dict[str, Any], place: _Place, value: Any) -> None:
    if place == "tool_schema":
        tool = _first_dict(_list_field(doc, "tools"), {"functionDeclarations": [{"name": "probe"}]})
        declarations = _list_field(tool, "functionDeclarations")
        # both fields: ``parameters`` (OpenAPI subset, upper-case types) and ``parametersJsonSchema``
        _first_dict(declarations, {"name": "probe"})["parameters"] = value
        declarations.append({"name": "probe_json", "parametersJsonSchema": value})
    elif place == "tool_choice":
        doc["toolConfig"] = {"functionCallingConfig": value}
    elif place == "chat_template_kwargs":
        doc["chat_template_kwargs"] = {"extra": value}
    elif place == "response_schema":
        config = _dict_field(doc, "generationConfig", {})
        config["responseMimeType"] = "application/json"
        config["responseJsonSchema"] = value
    else:
        args = value if place == "tool_args" else {"json": value if isinstance(value, str) else json.dumps(value)}
        _list_field(doc, "contents").extend([
            {"role": "model", "parts": [{"functionCall": {"name": "bash", "args": args}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response": {"output": "ok"}}}]}])


_PUT = {"openai.chat": _put_chat, "openai.responses": _put_responses, "anthropic.messages": _put_messages,
        "gemini": _put_gemini}


# -- reasoning signatures -----------------------------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _responses_encoding(data: bytes, digest_of: bytes | None = None) -> str:
    """Our ``encrypted_content`` layout (``rwr1.`` + urlsafe base64 + ``.`` + sha256 prefix) over raw bytes."""
    digest = hashlib.sha256(data if digest_of is None else digest_of).hexdigest()[:16]
    return "rwr1." + base64.urlsafe_b64encode(data).decode("ascii") + "." + digest


_BOMB = zlib.compress(b"a" * (16 * MIB), 9)  # 16 MiB of text (over every body limit) in about 16 KiB
_INVALID_UTF8 = b"\xff\xfe\xc3\x28 reasoning \xed\xa0\x80"


def signatures(api: ApiName) -> tuple[tuple[str, str], ...]:
    """(label, value) pairs of damaged or hostile reasoning signatures for ``api``."""
    common = (("not-base64", "!!not base64!!"), ("lone-surrogate", "sig\ud800"), ("non-ascii", "签名"),
              ("empty", ""), ("huge", "A" * (512 * 1024)), ("padding", "===="))
    if api == "anthropic.messages":
        return common + (("prefix-garbage", "rwt1.!!!"), ("prefix-not-zlib", "rwt1." + _b64(b"plain text")),
                         ("prefix-invalid-utf8", "rwt1." + _b64(zlib.compress(_INVALID_UTF8))),
                         ("prefix-bomb", "rwt1." + _b64(_BOMB)),
                         ("prefix-truncated-zlib", "rwt1." + _b64(zlib.compress(b"thinking")[:-3])),
                         ("prefix-surrogate", "rwt1.\ud800"), ("foreign", _b64(b"x" * 48)))
    if api == "gemini":
        return common + (("magic-garbage", _b64(b"rw1" + b"garbage")),
                         ("magic-invalid-utf8", _b64(b"rw1" + zlib.compress(_INVALID_UTF8))),
                         ("magic-bomb", _b64(b"rw1" + _BOMB)),
                         ("magic-truncated-zlib", _b64(b"rw1" + zlib.compress(b"thought")[:-3])),
                         ("urlsafe-alphabet", base64.urlsafe_b64encode(b"rw1\xfb\xff\xfe").decode()),
                         ("foreign", _b64(b"y" * 48)))
    if api == "openai.responses":
        return common + (("prefix-garbage", "rwr1.!!!.0000"), ("prefix-only", "rwr1."),
                         ("prefix-bad-digest", _responses_encoding(b"reasoning", b"other")),
                         ("prefix-invalid-utf8", _responses_encoding(_INVALID_UTF8)),
                         ("prefix-surrogate", "rwr1.\ud800.abc"), ("prefix-no-dot", "rwr1.cmVhc29u"),
                         ("foreign", "gAAAAA" + _b64(b"z" * 64)))
    return common


def _put_signature(api: ApiName, doc: dict[str, Any], value: str, on_call: bool) -> None:
    """A reasoning block carrying ``value`` as its signature, in the history, where each API puts one."""
    if api == "anthropic.messages":
        thinking = {"type": "thinking", "thinking": "I should look at the file.", "signature": value}
        blocks: list[dict[str, Any]] = [thinking]
        if on_call:
            blocks.append({"type": "tool_use", "id": "toolu_sig", "name": "Bash", "input": {"command": "ls"}})
            follow = [{"type": "tool_result", "tool_use_id": "toolu_sig", "content": "a.txt"}]
        else:
            blocks.append({"type": "text", "text": "Looking."})
            follow = [{"type": "text", "text": "go on"}]
        _list_field(doc, "messages").extend([{"role": "assistant", "content": blocks},
                                               {"role": "user", "content": follow}])
    elif api == "gemini":
        if on_call:
            parts = [{"functionCall": {"name": "bash", "args": {"command": "ls"}}, "thoughtSignature": value}]
            follow = [{"functionResponse": {"name": "bash", "response": {"output": "a.txt"}}}]
        else:
            parts = [{"text": "thinking", "thought": True, "thoughtSignature": value}, {"text": "Looking."}]
            follow = [{"text": "go on"}]
        _list_field(doc, "contents").extend([{"role": "model", "parts": parts}, {"role": "user", "parts": follow}])
    elif api == "openai.responses":
        items = doc.get("input") if isinstance(doc.get("input"), list) else []
        reasoning = {"type": "reasoning", "id": "rs_fz", "summary": [], "encrypted_content": value}
        if on_call:
            tail = [{"type": "function_call", "name": "exec_command", "arguments": '{"cmd":"ls"}', "call_id": "c_sig"},
                    {"type": "function_call_output", "call_id": "c_sig", "output": "a.txt"}]
        else:
            tail = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]}]
        doc["input"] = [*items, reasoning, *tail]
    else:  # chat has no signatures: vLLM's reasoning echo field instead
        _list_field(doc, "messages").extend([{"role": "assistant", "content": "Looking.", "reasoning": value},
                                               {"role": "user", "content": "go on"}])


# -- unknown roles and types, empty arrays ------------------------------------------------------------

_UNKNOWN_ROLES = ("wizard", "", "ASSISTANT", "function", "tool", "model", "system", 7, None)
# Unknown block/item types, and schema types as other dialects write them (a list, Gemini's upper case).
_UNKNOWN_TYPES = ("unknown", "", "image", "document", "server_tool_use", "web_search_tool_result", "computer_call",
                  "input_image", "item_reference", "refusal", 3, None, ["string", "null"], ["object"], [],
                  "STRING", "OBJECT", "ARRAY", "TYPE_UNSPECIFIED", {"type": "string"})


def _role_paths(api: ApiName, doc: dict[str, Any]) -> list[JsonPath]:
    container = "contents" if api == "gemini" else ("input" if api == "openai.responses" else "messages")
    items = doc.get(container)
    if not isinstance(items, list):
        return []
    return [(container, i, "role") for i, item in enumerate(items) if isinstance(item, dict)]


def _type_paths(doc: dict[str, Any]) -> list[JsonPath]:
    return [path for path in json_paths(doc) if path and path[-1] == "type"]


def _array_paths(doc: dict[str, Any]) -> list[JsonPath]:
    return [path for path in json_paths(doc) if isinstance(_get(doc, path), list)]


# -- the strategies -----------------------------------------------------------------------------------

@st.composite
def _path(draw: st.DrawFn, doc: dict[str, Any], top_level_bias: bool = True) -> JsonPath | None:
    paths = json_paths(doc)
    if not paths:
        return None
    if top_level_bias and draw(st.booleans()):
        paths = [p for p in paths if len(p) <= 2] or paths
    return paths[draw(st.integers(0, len(paths) - 1))]


@st.composite
def _mutate(draw: st.DrawFn, api: ApiName, doc: dict[str, Any]) -> Mutation:
    """Apply one drawn mutation to ``doc`` in place; returns what it did."""
    op = draw(st.sampled_from(("drop", "replace", "retype", "duplicate", "huge", "unicode", "surrogate", "deep",
                               "signature", "role", "type", "empty", "stream")))
    if op in ("drop", "replace", "retype", "duplicate", "huge", "unicode", "surrogate"):
        path = draw(_path(doc))
        if path is None:
            return Mutation("noop")
        current = _get(doc, path)
        where = _show(path)
        if op == "drop":
            _drop(doc, path)
            return Mutation("drop", where)
        if op == "replace":
            value = draw(st.sampled_from(_WRONG_VALUES))
            _set(doc, path, copy.deepcopy(value))
            return Mutation("replace", where, _abbrev(value))
        if op == "retype":
            if isinstance(current, str):
                value = draw(st.sampled_from(([current], {"text": current}, len(current), None, True, 0.5)))
            else:
                value = draw(st.sampled_from((json.dumps(current)[:200], "", "true", "[]")))
            _set(doc, path, value)
            return Mutation("retype", where, _abbrev(value))
        if op == "duplicate":
            parent = _get(doc, path[:-1])
            if isinstance(parent, list):
                times = draw(st.sampled_from((1, 2, 50)))
                for _ in range(times):
                    parent.insert(path[-1], copy.deepcopy(current))
                return Mutation("duplicate", where, f"x{times + 1}")
            key = draw(st.sampled_from(("model", "stream", "messages", "role", "type", "content", "tools")))
            parent[key] = copy.deepcopy(current)
            return Mutation("copy-to-key", where, key)
        if op == "huge":
            size = draw(st.sampled_from((64 * 1024, 512 * 1024, 2 * MIB)))
            _set(doc, path, draw(st.sampled_from(("A", "é", "🦀", "\\"))) * size)
            return Mutation("huge-string", where, f"{size} chars")
        if op == "unicode":
            value = draw(st.sampled_from(NON_ASCII))
            _set(doc, path, value if not isinstance(current, str) or draw(st.booleans()) else current + value)
            return Mutation("non-ascii", where, _abbrev(value))
        value = draw(st.sampled_from(LONE_SURROGATES))
        _set(doc, path, value if not isinstance(current, str) else current[:20] + value)
        return Mutation("lone-surrogate", where, _abbrev(value))
    if op == "deep":
        place = draw(st.sampled_from(PLACES))
        shape = draw(st.sampled_from(("obj", "list", "schema", "mixed")))
        depth = draw(st.sampled_from(_DEEP_DEPTHS))
        if place == "tool_args_string":
            value: Any = deep_json(shape, min(depth, 20_000))  # JSON text inside a JSON string
        else:
            value = deep_marker(shape, depth)
        _PUT[api](doc, place, value)
        return Mutation("deep", place, f"{shape}x{depth}")
    if op == "signature":
        label, value = draw(st.sampled_from(signatures(api)))
        on_call = draw(st.booleans())
        _put_signature(api, doc, value, on_call)
        return Mutation("signature", "tool-call" if on_call else "text", label)
    if op == "role":
        paths = _role_paths(api, doc)
        role = draw(st.sampled_from(_UNKNOWN_ROLES))
        if not paths:
            return Mutation("noop")
        path = paths[draw(st.integers(0, len(paths) - 1))]
        _set(doc, path, role)
        return Mutation("role", _show(path), repr(role))
    if op == "type":
        paths = _type_paths(doc)
        kind = draw(st.sampled_from(_UNKNOWN_TYPES))
        if not paths:
            return Mutation("noop")
        path = paths[draw(st.integers(0, len(paths) - 1))]
        _set(doc, path, kind)
        return Mutation("type", _show(path), repr(kind))
    if op == "empty":
        paths = _array_paths(doc)
        if not paths:
            return Mutation("noop")
        path = paths[draw(st.integers(0, len(paths) - 1))] if draw(st.booleans()) else paths[0]
        _set(doc, path, [])
        return Mutation("empty-array", _show(path))
    value = draw(st.sampled_from((True, False, None, "true", 1, [], "yes")))
    doc["stream"] = value
    return Mutation("stream", "stream", repr(value))


def serialize(doc: Any, ascii_only: bool) -> bytes:
    """The body text: JSON with deep-nesting markers spliced in. ``ascii_only`` writes non-ASCII and lone
    surrogates as ``\\uXXXX`` escapes; otherwise UTF-8, where a lone surrogate becomes invalid UTF-8 bytes."""
    text = json.dumps(doc, ensure_ascii=ascii_only, separators=(",", ":"))
    raw = text.encode("utf-8", errors="surrogatepass")
    return _DEEP.sub(lambda m: deep_json(m.group(1).decode(), int(m.group(2))).encode(), raw)


_CONTENT_TYPES = ("text/plain", None, "application/x-www-form-urlencoded", "multipart/form-data; boundary=xx",
                  "application/json; charset=utf-16", "APPLICATION/JSON", "application/vnd.api+json",
                  "application/jsonl", "text/json", "application/octet-stream", "", "*/*")

_RAW_BODIES: tuple[tuple[str, bytes], ...] = (
    ("empty", b""), ("brace", b"{"), ("not-json", b"{not json"), ("null", b"null"), ("array", b"[]"),
    ("array-of-numbers", b"[1,2]"), ("string", b'"text"'), ("number", b"123"), ("true", b"true"),
    ("binary", b"\xff\xfe\x00\x01garbage"), ("nan", b'{"messages":NaN}'), ("trailing", b'{"model":"m"} trailing'),
    ("form", b"model=m&stream=true"), ("utf16", '{"model":"m"}'.encode("utf-16")),
    ("deep-array-only", b"[" * 200_000 + b"]" * 200_000), ("unterminated-string", b'{"model":"m'),
    ("duplicate-keys", b'{"stream":true,"stream":"x","model":1,"model":"m"}'),
    ("nul-bytes", b'{"model":"m\x00"}'), ("invalid-utf8-in-string", b'{"model":"\xc3\x28"}'),
)

_UNKNOWN_ROUTES: dict[ApiName, tuple[tuple[str, bool], ...]] = {
    # (route, records): records when the route is served by the provider (the proxy answers its 404 itself)
    "openai.chat": (("/v1/chat/completion", False), ("/v1/chat/completions/extra", False), ("/v1/completions", False),
                    ("/v1/fine_tuning/jobs", False), ("/v1/embeddings", False), ("/v1/chat", False),
                    ("/v1/chat/completions/", False)),
    "openai.responses": (("/v1/responses/resp_123", False), ("/v1/responses/resp_1/cancel", False),
                         ("/v1/responses/input_tokens", False), ("/v1/responsesX", False), ("/v1/responses/", False)),
    "anthropic.messages": (("/v1/messages/batches", False), ("/v1/messages/count_token", False),
                           ("/v1/messages/msg_1", False), ("/v1/messages/", False)),
    # (GET /v1/models, /v1beta/models[/MODEL] and POST :countTokens are served: proxy/apis/model_catalog.py)
    "gemini": (("/v1beta/corpora", False), ("/v1beta/files", False), ("/v1beta/cachedContents", False),
               ("/v1beta/models/gemini-2.5-flash:predict", True),
               ("/v1beta/models/gemini-2.5-flash:embedContent", True),
               ("/v1beta/models/:generateContent", True), ("/v1beta/tunedModels/x:generateContent", False)),
}
_QUERY_EXTRAS: dict[ApiName, tuple[tuple[str, str], ...]] = {
    # Gemini: only on streamGenerateContent does ``alt`` matter (sse or the JSON array); the rest are ignored
    "openai.chat": (("stream", "true"), ("api-version", "2024-10-21"), ("beta", "true")),
    "openai.responses": (("stream", "true"), ("include", "reasoning.encrypted_content")),
    "anthropic.messages": (("beta", "true"), ("beta", "false"), ("beta", "")),
    "gemini": (("alt", "json"), ("$alt", "json;enum-encoding=int"), ("prettyPrint", "false")),
}
_WRONG_METHODS = ("GET", "PUT", "DELETE", "PATCH", "OPTIONS")

# Headers the proxy reads besides the key (retry count, lineage hints), with hostile values. Values are
# bytes: HTTP carries Latin-1, which is how the server decodes them. Control characters are left out: the
# HTTP server (uvicorn) refuses those with its own plain 400 before the app sees the request.
_HEADER_VALUES: tuple[tuple[str, bytes], ...] = (
    ("x-stainless-retry-count", b"1"), ("x-stainless-retry-count", b"abc"), ("x-stainless-retry-count", b"-1"),
    ("x-stainless-retry-count", b"\xb2"), ("x-stainless-retry-count", b"\xb9\xb2\xb3"),
    ("x-stainless-retry-count", b"9" * 5000), ("x-stainless-retry-count", b"99999999999999999999999"),
    ("x-stainless-retry-count", b""), ("x-claude-code-session-id", b"\xff\xfe" * 8),
    ("x-claude-code-session-id", b"s" * 32_000), ("session_id", b"\xe6\x97\xa5\xe6\x9c\xac"),
    ("conversation_id", b"../../etc/passwd"), ("x-rollwire-parent", b"\xa0\xff"), ("x-rollwire-agent", b"a" * 2000),
    ("content-encoding", b"gzip"), ("content-encoding", b"zstd"),
    ("accept", b"text/event-stream"), ("accept", b"application/xml"), ("accept-encoding", b"br"),
)


@st.composite
def _auth(draw: st.DrawFn) -> tuple[AuthMode, KeyCarrier, int]:
    auth = draw(st.sampled_from(AuthMode))
    if draw(st.integers(0, 3)) > 0:  # weighted towards the authenticated modes, which exercise the most code
        auth = draw(st.sampled_from((AuthMode.OWN, AuthMode.OWN, AuthMode.KEY_ONLY)))
    carrier = draw(st.sampled_from(KeyCarrier))
    session = draw(st.integers(0, 1))
    return auth, carrier, session


def _route_and_stream(api: ApiName, doc: Any, gemini_stream: bool, sse: bool) -> tuple[str, tuple, bool | None]:
    if api == "gemini":
        route = gemini_route("streamGenerateContent" if gemini_stream else "generateContent")
        return route, ((("alt", "sse"),) if gemini_stream and sse else ()), gemini_stream
    stream = doc.get("stream") if isinstance(doc, dict) else None
    return API_ROUTES[api], (), (stream if isinstance(stream, bool) else (False if isinstance(doc, dict)
                                                                           and "stream" not in doc else None))


@st.composite
def fuzz_requests(draw: st.DrawFn) -> FuzzRequest:
    """A mutated provider request: one of the four APIs, from a recorded CLI request, sent some way."""
    api: ApiName = draw(st.sampled_from(("openai.chat", "openai.responses", "anthropic.messages", "gemini")))
    seed = draw(st.sampled_from(seeds_of(api)))
    doc = copy.deepcopy(seed.body)
    auth, carrier, session = draw(_auth())
    gemini_stream, sse = draw(st.booleans()), draw(st.integers(0, 4)) > 0
    common = dict(api=api, seed=seed.name, session=session, auth=auth, carrier=carrier)
    if draw(st.integers(0, 9)) == 0:
        common["headers"] = tuple(draw(st.lists(st.sampled_from(_HEADER_VALUES), min_size=1, max_size=2,
                                                unique_by=lambda h: h[0])))
    kind = draw(st.sampled_from(("mutated",) * 14 + ("raw", "content_type", "method", "path", "valid", "gzip")))
    if kind == "gzip":
        route, query, stream = _route_and_stream(api, doc, gemini_stream, sse)
        encoding = draw(st.sampled_from((b"gzip", b"deflate", b"")))
        body = gzip.compress(serialize(doc, True)) if encoding != b"deflate" else zlib.compress(serialize(doc, True))
        return FuzzRequest(**{**common, "headers": (("content-encoding", encoding),) if encoding else ()},
                           method="POST", route=route, query=query, body=body, stream=stream,
                           mutations=(Mutation("compressed-body", value=encoding.decode() or "undeclared"),))
    if kind == "raw":
        label, body = draw(st.sampled_from(_RAW_BODIES))
        if label == "empty" and draw(st.booleans()):
            label, body = "truncated-seed", serialize(doc, True)[: draw(st.integers(1, 400))]
        route, query, _ = _route_and_stream(api, doc, gemini_stream, sse)
        return FuzzRequest(**common, method="POST", route=route, query=query, body=body,
                           mutations=(Mutation("raw-body", value=label),))
    if kind == "content_type":
        content_type = draw(st.sampled_from(_CONTENT_TYPES))
        route, query, stream = _route_and_stream(api, doc, gemini_stream, sse)
        return FuzzRequest(**common, method="POST", route=route, query=query, body=serialize(doc, True),
                           content_type=content_type, stream=stream,
                           mutations=(Mutation("content-type", value=repr(content_type)),))
    if kind == "method":
        method = draw(st.sampled_from(_WRONG_METHODS))
        route, query, _ = _route_and_stream(api, doc, gemini_stream, sse)
        body = serialize(doc, True) if method != "GET" else b""
        return FuzzRequest(**common, method=method, route=route, query=query, body=body, records=False,
                           mutations=(Mutation("method", value=method),))
    if kind == "path":
        route, records = draw(st.sampled_from(_UNKNOWN_ROUTES[api]))
        method = draw(st.sampled_from(("POST", "POST", "GET")))
        return FuzzRequest(**common, method=method, route=route, body=serialize(doc, True) if method == "POST" else b"",
                           records=records and method == "POST", mutations=(Mutation("path", route, method),))
    mutations: list[Mutation] = []
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 3))):
            mutations.append(draw(_mutate(api, doc)))
        if api != "gemini" and draw(st.integers(0, 3)) == 0 and isinstance(doc, dict):
            value = draw(st.booleans())
            doc["stream"] = value
            mutations.append(Mutation("stream", "stream", repr(value)))
    ascii_only = draw(st.integers(0, 3)) > 0
    body = serialize(doc, ascii_only)
    if not ascii_only:
        mutations.append(Mutation("utf-8-body"))
    route, query, stream = _route_and_stream(api, doc, gemini_stream, sse)
    if draw(st.integers(0, 9)) == 0:  # query parameters the APIs define, with unusual values
        extra = draw(st.sampled_from(_QUERY_EXTRAS[api]))
        query = (*(q for q in query if q[0] != extra[0]), extra)
        mutations.append(Mutation("query", value=f"{extra[0]}={extra[1]}"))
    disconnect = draw(st.integers(0, 14)) == 0
    return FuzzRequest(**common, method="POST", route=route, query=query, body=body, stream=stream,
                       disconnect=disconnect, mutations=tuple(mutations))


def large_body_requests(sizes: tuple[int, ...] = (4 * MIB - 4096, 4 * MIB + 4096, 8 * MIB - 4096, 8 * MIB + 4096,
                                                  16 * MIB + 4096)) -> list[FuzzRequest]:
    """Bodies near and over the body limits (4 MiB: half the Kafka record; 8 MiB: the record; 16 MiB: the
    old default): one per API and size, the first seed of each API padded by one long user text; every
    other one sent chunked (no Content-Length)."""
    out = []
    for api in ("openai.chat", "openai.responses", "anthropic.messages", "gemini"):
        seed = seeds_of(api)[0]
        for n, size in enumerate(sizes):
            doc = copy.deepcopy(seed.body)
            base = len(serialize(doc, True))
            _append_user_text(api, doc, "P" * max(0, size - base - 200))
            body = serialize(doc, True)
            route, query, stream = _route_and_stream(api, doc, True, True)
            out.append(FuzzRequest(api=api, seed=seed.name, method="POST", route=route, query=query, body=body,
                                   chunked=n % 2 == 1, stream=stream,
                                   mutations=(Mutation("large-body", value=f"{len(body)} bytes"),)))
    return out


def _append_user_text(api: ApiName, doc: dict[str, Any], text: str) -> None:
    if api == "gemini":
        doc["contents"].append({"role": "user", "parts": [{"text": text}]})
    elif api == "openai.responses":
        doc["input"].append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    elif api == "anthropic.messages":
        doc["messages"].append({"role": "user", "content": [{"type": "text", "text": text}]})
    else:
        doc["messages"].append({"role": "user", "content": text})


def minimal_request(api: ApiName, stream: bool, sse: bool = True) -> FuzzRequest:
    """The first recorded request of ``api``, unmutated, streamed or not (for the engine-failure tests);
    ``sse`` false streams Gemini as a JSON array (no ``alt=sse``)."""
    seed = seeds_of(api)[0]
    doc = copy.deepcopy(seed.body)
    if api != "gemini":
        doc["stream"] = stream
    route, query, _ = _route_and_stream(api, doc, stream, sse)
    return FuzzRequest(api=api, seed=seed.name, method="POST", route=route, query=query,
                       body=serialize(doc, True), stream=stream)
