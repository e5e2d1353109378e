"""The OpenAI-compatible HTTP gateway: ``tokenrelay gateway``.

Needs the ``gateway`` extra (FastAPI, uvicorn, prometheus_client); never imports torch, the
engine or the worker. ``create_app(GatewaySettings(...))`` builds the ASGI app for your own
server; see docs/gateway.md.
"""

from tokenrelay.producer_sdk.gateway.app import create_app
from tokenrelay.producer_sdk.gateway.models import HeartbeatDirectory, ModelDirectory
from tokenrelay.producer_sdk.core.models import ServedModel
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings

__all__ = ["create_app", "GatewaySettings", "ModelDirectory", "HeartbeatDirectory",
           "ServedModel"]
