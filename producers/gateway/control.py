"""The gateway node's HTTP endpoint: health, the sessions it holds, and cancelling one of them.

``GET /health``, ``GET /v1/sessions``, ``POST /v1/sessions/{session_id}/cancel`` (body optional:
``{"reason": "..."}``). A session is cancelled on the node that holds it, the ``node`` of its latest
``session.stage`` event; another node answers 404.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from producers.gateway.node import GatewayNode, stages_held
from producers.validation_errors import install_validation_handler
from schemas.rollouts import CancelAnswer, CancelRequest, GatewayHealth, HeldSession


def create_app(node: GatewayNode) -> FastAPI:
    app = FastAPI(title="rollwire gateway node", docs_url=None, redoc_url=None)
    install_validation_handler(app)

    @app.get("/health")
    async def health() -> GatewayHealth:
        return GatewayHealth(status="draining" if node.draining else "ok", node=node.name, group=node.group,
                             sessions=stages_held(node.held()), waiting=node.waiting())

    @app.get("/v1/sessions")
    async def sessions() -> list[HeldSession]:
        return [HeldSession(session_id=s.session_id, task_id=s.spec.task_id, stage=s.stage, claimed=s.claimed,
                            cancel_reason=s.cancel_reason) for s in node.held()]

    @app.post("/v1/sessions/{session_id}/cancel", response_model=None)
    async def cancel(session_id: str, body: CancelRequest | None = None) -> CancelAnswer | JSONResponse:
        reason = (body or CancelRequest()).reason
        session = node.cancel(session_id, reason)
        if session is None:
            return JSONResponse({"detail": f"session {session_id!r} is not held by gateway node {node.name}"},
                                status_code=404)
        return CancelAnswer(session_id=session_id, node=node.name, stage=session.stage,
                            cancelled=session.cancel_reason == reason)

    return app
