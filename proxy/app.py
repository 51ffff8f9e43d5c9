"""The proxy's HTTP app: its parts started and stopped with the app's lifespan, its routers, its error handlers.

Routes stay thin (:mod:`proxy.routes`): they authenticate the call (the session's key, also on ``/s/{id}/``
paths), read the body within limits (:mod:`proxy.limits`), and hand the call to
:class:`~proxy.calls.CallService`. Errors are answered in the caller's protocol (:mod:`proxy.routes.errors`),
and every call past the key is recorded, refused ones as failed calls.

The admin API (the policy API, creating sessions, reading or ending any session) needs
``ROLLWIRE_PROXY_ADMIN_TOKEN`` as a bearer token when one is set; a session's key never works there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from starlette.types import Receive, Scope, Send

from proxy.routes import attach_routers
from proxy.routes.calls import direct_endpoint
from proxy.routes.errors import install_error_handlers
from proxy.settings import ProxySettings
from proxy.state import ProxyState
from schemas.transport import KafkaSettings


class ProxyApp(FastAPI):
    """The proxy's FastAPI app, which hands a model call (a POST on a call path, by key or under its
    session's path) straight to its endpoint: the framework's per-request layers (its middleware, the match
    against every route, the endpoint's dependencies) stay off the path of every call's first bytes, which
    at a burst of calls queue behind each other's. The endpoint answers every failure itself, in the
    provider's shape. Everything else (the lifespan, every other path and method) goes through FastAPI."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            direct = direct_endpoint(scope["path"])
            if direct is not None:
                endpoint, session_id = direct
                scope["app"] = self
                response = await endpoint(Request(scope, receive), session_id)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: ProxySettings | None = None, kafka: KafkaSettings | None = None, *,
               engine_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy app; Kafka clients and the engine client start with the app's lifespan."""
    settings = settings or ProxySettings()
    kafka = kafka or KafkaSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ProxyState.build(settings, kafka, engine_transport)
        await state.start()
        app.state.proxy = state
        try:
            yield
        finally:
            await state.stop()

    app = ProxyApp(title="rollwire proxy", lifespan=lifespan)
    # A trailing slash is another path, answered 404 in the provider's shape, not a 307 with an empty body.
    app.router.redirect_slashes = False
    attach_routers(app)
    install_error_handlers(app)
    return app
