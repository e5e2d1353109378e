"""``tokenrelay gateway``: serve the OpenAI-compatible API with uvicorn.

Every flag is also a ``TOKENRELAY_<NAME>`` variable (``protocol/settings.py``). A bad
value or an unreadable key file ends with exit 2 and one line saying which.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from tokenrelay.heap import collect_young_less_often
from tokenrelay.protocol.settings import EXIT_USAGE, add_settings_flags, parse_settings


def parser() -> argparse.ArgumentParser:
    from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
    p = argparse.ArgumentParser(prog="tokenrelay gateway",
                                description="OpenAI-compatible HTTP API over tokenrelay queues: "
                                            "/v1/completions, /v1/chat/completions, /v1/models, "
                                            "/health, /metrics.")
    add_settings_flags(p, GatewaySettings)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    import uvicorn

    from tokenrelay.producer_sdk.gateway.app import create_app
    from tokenrelay.producer_sdk.gateway.auth import KeyFileError
    from tokenrelay.producer_sdk.gateway.http import server_config
    from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
    _, settings = parse_settings(parser(), argv)
    assert isinstance(settings, GatewaySettings)
    try:
        app = create_app(settings)
    except (KeyFileError, ValueError) as exc:
        print(f"tokenrelay gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    collect_young_less_often()          # tokenrelay/heap.py: why
    uvicorn.Server(server_config(app, settings)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
