"""The stand-in engine's context limits behave as vLLM 0.32's (the recorded overflow fixture and
vllm/entrypoints/serve/utils/api_utils.py get_max_tokens): a max_tokens that does not fit beside the
prompt is clamped to what is left, a prompt that fills the context is refused naming input_tokens, and a
max_tokens over the whole context is refused naming max_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.support.standin_engine import StandinConfig, create_app, render_prompt, tokenize

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
MESSAGES = [{"role": "user", "content": "hi there"}]


async def test_limits_are_vllms() -> None:
    context = 200
    transport = httpx.ASGITransport(app=create_app(StandinConfig(latency_ms=0, reply_tokens=500,
                                                                 max_model_len=context)))
    async with httpx.AsyncClient(transport=transport, base_url="http://standin") as standin:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 190}
        prompt_len = len(tokenize(render_prompt(body)))
        reply = await standin.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert len(choice["token_ids"]) == context - prompt_len and choice["finish_reason"] == "length"

        long = {"model": "m", "messages": [{"role": "user", "content": "x" * context}], "max_tokens": 1}
        refused = await standin.post("/v1/chat/completions", json=long)
        recorded = json.loads((FIXTURES / "error_context_overflow.json").read_text())["response"]["error"]
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == recorded["param"] == "input_tokens"
        assert error["type"] == recorded["type"]
        lead = "This model's maximum context length is {} tokens. However, your prompt contains"
        assert recorded["message"].startswith(lead.format(4096)) and error["message"].startswith(lead.format(context))

        over = await standin.post("/v1/chat/completions", json={**body, "max_tokens": context + 1})
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
