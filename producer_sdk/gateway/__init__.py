"""The OpenAI-compatible HTTP gateway: ``python -m producer_sdk.gateway``.

Needs the ``gateway`` extra (FastAPI, uvicorn, prometheus_client); never imports torch, the
engine or the worker. ``create_app(GatewaySettings(...))`` builds the ASGI app for your own
server; see docs/gateway.md.
"""

from producer_sdk.gateway.app import create_app
from producer_sdk.gateway.models import HeartbeatDirectory, ModelDirectory
from producer_sdk.models import ServedModel
from producer_sdk.gateway.settings import GatewaySettings

__all__ = ["create_app", "GatewaySettings", "ModelDirectory", "HeartbeatDirectory",
           "ServedModel"]
