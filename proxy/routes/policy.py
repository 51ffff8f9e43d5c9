"""The policy API (admin only): the version the engines serve, weight updates (:mod:`proxy.policy`), and the
state of each engine of the pool."""

from __future__ import annotations

import asyncio

from typing import Any

from fastapi import APIRouter, Depends, Request

from proxy.errors import ApiError, ProxyError
from proxy.routes.access import require_admin
from proxy.routes.sessions import read_model
from proxy.state import ProxyState, proxy_state
from schemas.api import PolicyState, WeightUpdate

router = APIRouter(dependencies=[Depends(require_admin)])

_POLICY_BODY_BYTES = 64 * 1024


async def _served_model(state: ProxyState) -> str | None:
    try:
        return await state.engine.served_model()
    except ProxyError:
        return None


@router.get("/v1/policy", response_model=PolicyState)
async def get_policy(request: Request) -> PolicyState:
    state = proxy_state(request)
    await state.policy.refresh()
    try:
        return state.policy.state(await _served_model(state))
    except ProxyError as exc:
        raise ApiError(exc.status_code, exc.message) from exc


@router.post("/v1/policy/weights", response_model=PolicyState)
async def update_weights(request: Request) -> PolicyState:
    """Load new weights into the engines, every proxy process of the tier holding its calls meanwhile
    (:mod:`proxy.policy_tier`); one update at a time across the tier."""
    state = proxy_state(request)
    body = await read_model(request, WeightUpdate, _POLICY_BODY_BYTES)
    assert isinstance(body, WeightUpdate)
    try:
        # Shielded: a trainer that hangs up mid-update must not leave the gate closed or the engine paused.
        return await asyncio.shield(state.policy.update(body))
    except ProxyError as exc:
        raise ApiError(exc.status_code, exc.message) from exc


@router.get("/v1/engines")
async def list_engines(request: Request) -> list[dict[str, Any]]:
    """Each engine: health, calls in flight and in all, errors, version, its own prefix-cache hit rate."""
    return proxy_state(request).pool.states()
