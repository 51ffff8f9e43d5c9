"""The proxy's routes, one router per family: model calls, model listings, sessions, policy, operations.

The model calls and listings are served twice: by the session's key alone (``/v1/...``) and under the
session's own path (``/s/{session_id}/v1/...``); :func:`attach_routers` registers each of their paths at
both places, so the two can never drift apart.
"""

from __future__ import annotations

from fastapi import FastAPI

from proxy.routes import calls, models, ops, policy, sessions

SESSION_PATH = "/s/{session_id}"


def attach_routers(app: FastAPI) -> None:
    for router in (calls.router, models.router):
        app.include_router(router)
        app.include_router(router, prefix=SESSION_PATH)
    for router in (sessions.router, policy.router, ops.router):
        app.include_router(router)
