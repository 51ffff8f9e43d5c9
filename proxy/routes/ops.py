"""Operations: health, Prometheus metrics, and the preflight some harnesses send before their first call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from proxy.state import proxy_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = proxy_state(request)
    return {"status": "ok", "kafka": state.recorder.connected,
            "registry_caught_up": state.feed.caught_up.is_set(), "sessions": state.registry.counts()}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = proxy_state(request)
    return Response(state.metrics.render(state.registry.counts()), media_type="text/plain; version=0.0.4")


@router.head("/")
@router.head("/s/{session_id}")
async def preflight(session_id: str | None = None) -> Response:
    return Response(status_code=200)  # Claude Code's HEAD / before its first call
