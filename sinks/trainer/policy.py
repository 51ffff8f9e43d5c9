"""The weight push: the client of the proxy's policy API (``POST /v1/policy/weights``, ``GET /v1/policy``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from schemas.admin_token import admin_token
from schemas.api import PolicyState, WeightUpdate
from sinks.errors import PolicyApiError


@dataclass
class PolicyClient:
    """The proxy's weight endpoints: ``POST /v1/policy/weights`` and ``GET /v1/policy``."""

    proxy_url: str
    admin_token: str | None = field(default_factory=admin_token)
    timeout_s: float = 900.0

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def state(self) -> PolicyState:
        """``GET /v1/policy``: the version serving, whether an update runs, pause figures."""
        return self._call("GET", "/v1/policy", timeout_s=30)

    def push(self, weights_path: Path, version: int, drain_timeout_s: float = 600.0) -> PolicyState:
        """Have the engine behind the proxy load ``weights_path`` as policy ``version``; returns once it serves."""
        update = WeightUpdate(weights_path=str(weights_path.resolve()), version=str(version),
                              drain_timeout_s=drain_timeout_s)
        return self._call("POST", "/v1/policy/weights", body=update.model_dump(),
                          timeout_s=self.timeout_s + drain_timeout_s)

    def _call(self, method: str, path: str, *, timeout_s: float, body: dict[str, Any] | None = None) -> PolicyState:
        url = f"{self.proxy_url.rstrip('/')}{path}"
        try:
            response = httpx.request(method, url, json=body, headers=self._headers(), timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise PolicyApiError(f"{method} {url} got no answer: {exc!r}") from exc
        if response.status_code != 200:
            raise PolicyApiError(f"{method} {url} answered {response.status_code}: {response.text[:2000]}")
        return PolicyState.model_validate(response.json())
