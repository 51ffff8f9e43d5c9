"""The 422 that rollwire's own HTTP services (the rollout server, a gateway node's control endpoint)
answer for a request body that does not validate: FastAPI's shape (``{"detail": [{"loc", "msg", "type"}]}``)
without the offending input echoed back. FastAPI's default handler copies that input into the body, and
an input JSON cannot hold (a lone surrogate, an infinity) then made the answer a plain-text 500."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


def validation_detail(exc: RequestValidationError) -> list[dict[str, object]]:
    """Where and why each error is, as JSON-safe values only."""
    return [{"loc": [str(part) for part in error.get("loc", ())], "msg": str(error.get("msg", "invalid")),
             "type": str(error.get("type", "value_error"))} for error in exc.errors()]


def install_validation_handler(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_detail(exc)}, status_code=422)
