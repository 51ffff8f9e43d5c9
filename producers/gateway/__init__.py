"""Gateway nodes: a consumer group on ``sessions`` that runs each session through bounded stage pools
(runtime init, pre-warmed ready buffer, harness run, post-run, teardown) and reports it on
``session-events``. ``rollwire gateway-node`` runs one (producers.gateway.cli)."""

from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings

__all__ = ["GatewayNode", "GatewaySettings"]
