"""Does the proxy still answer while it relays one long stream? The stand-in engine beside the real vLLM.

One session streams a long call through the proxy (``--tokens``, default 12,000, ``min_tokens`` so the
real model cannot stop early) while three pollers ask, every 0.1 s: the proxy's ``/health`` (no engine
call), its ``GET /v1/policy`` (reads the engine's weight version) and the engine's own ``/health``. Prints
per engine and poller the longest answer, and how long the stream took. First the stand-in engine at a
paced ``--token-interval-ms`` (a stream as long as vLLM's on this machine), then the embedded vLLM CPU
server (started here unless ``ROLLWIRE_ENGINE_URL`` names one; Kafka must be up: ``rollwire up``).

    python -m bench.stream_responsiveness [--tokens 12000] [--token-interval-ms 4] [--no-vllm]

Prints ``name=value`` lines, the key figure last: ``vllm_proxy_health_max_ms`` (what a weight update, a
new call or a health check waits at most while one long call streams).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import httpx

from bench.serving import serve
from tests.support.standin_engine import StandinConfig, create_app as create_standin
from deploy import stack
from proxy.app import create_app
from proxy.settings import ProxySettings
from schemas.transport import KafkaSettings, ensure_topics

PROMPT = [{"role": "system", "content": "You are a coding agent."},
          {"role": "user", "content": "Fix the failing test in utils.py."}]


async def _poll(url: str, done: asyncio.Event, waits: list[float]) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        while not done.is_set():
            began = time.monotonic()
            try:
                await client.get(url)
            except httpx.HTTPError:
                pass  # counted all the same: the wait is the figure
            waits.append(time.monotonic() - began)
            await asyncio.sleep(0.1)


async def _one_stream(engine_url: str, proxy_url: str, tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=60) as client:
        created = (await client.post(f"{proxy_url}/v1/sessions", json={"engine": {
            "seed": 4, "temperature": 1.0, "max_tokens": tokens, "extra": {"min_tokens": tokens}}})).json()
    done = asyncio.Event()
    waits: dict[str, list[float]] = {"proxy_health": [], "proxy_policy": [], "engine_health": []}
    pollers = [asyncio.create_task(_poll(url, done, waits[name])) for name, url in (
        ("proxy_health", f"{proxy_url}/health"), ("proxy_policy", f"{proxy_url}/v1/policy"),
        ("engine_health", f"{engine_url}/health"))]
    began = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=900) as client:
            async with client.stream("POST", f"{created['base_urls']['openai']}/chat/completions",
                                     headers={"authorization": f"Bearer {created['api_key']}"},
                                     json={"model": "m", "messages": PROMPT, "stream": True}) as response:
                async for _ in response.aiter_raw():
                    pass
    finally:
        done.set()
        await asyncio.gather(*pollers)
    figures = {"stream_s": time.monotonic() - began}
    for name, values in waits.items():
        figures[f"{name}_max_ms"] = max(values, default=0.0) * 1000
    return figures


async def _measure(engine_url: str, kafka: KafkaSettings, tokens: int) -> dict[str, float]:
    settings = ProxySettings(engine_url=engine_url, engine_timeout_s=900.0)
    with serve(create_app(settings, kafka)) as proxy_url:
        return await _one_stream(engine_url, proxy_url, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=12000)
    parser.add_argument("--token-interval-ms", type=float, default=4.0)
    parser.add_argument("--no-vllm", dest="vllm", action="store_false")
    args = parser.parse_args()
    kafka = KafkaSettings().model_copy(update={"topic_prefix": f"resp{uuid.uuid4().hex[:8]}."})
    asyncio.run(ensure_topics(kafka))
    results: dict[str, dict[str, float]] = {}
    standin = create_standin(StandinConfig(reply_tokens=args.tokens, token_interval_ms=args.token_interval_ms))
    with serve(standin) as standin_url:
        results["standin"] = asyncio.run(_measure(standin_url, kafka, args.tokens))
    if args.vllm:
        part = stack.engine(stack.external_engine_url(), stack.engine_config())
        try:
            results["vllm"] = asyncio.run(_measure(part.address, kafka, args.tokens))
        finally:
            if part.stop is not None:
                part.stop()
    for engine, figures in results.items():
        for name, value in figures.items():
            print(f"{engine}_{name}={value:.2f}")
    key = "vllm" if "vllm" in results else "standin"
    print(f"{key}_proxy_health_max_ms={results[key]['proxy_health_max_ms']:.0f}")


if __name__ == "__main__":
    main()
