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
from fastapi import FastAPI

from proxy.routes import attach_routers
from proxy.routes.errors import install_error_handlers
from proxy.settings import ProxySettings
from proxy.state import ProxyState
from schemas.transport import KafkaSettings


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

    app = FastAPI(title="rollwire proxy", lifespan=lifespan)
    # A trailing slash is another path, answered 404 in the provider's shape, not a 307 with an empty body.
    app.router.redirect_slashes = False
    attach_routers(app)
    install_error_handlers(app)
    return app
