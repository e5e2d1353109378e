"""``tokenrelay gateway``: serve the OpenAI-compatible API with uvicorn.

Every flag is also a ``TOKENRELAY_<NAME>`` variable (``protocol/settings.py``). A bad
value or an unreadable key file ends with exit 2 and one line saying which.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Optional, Sequence

from tokenrelay.protocol.settings import EXIT_USAGE, add_settings_flags, parse_settings

# Allocations between two young-generation collections (CPython's default: 700); see tune_gc.
YOUNG_GC_THRESHOLD = 10_000


def tune_gc() -> None:
    """Collect the young generation every ``YOUNG_GC_THRESHOLD`` allocations, not every 700.

    Why: at 2,000 streams the gateway's short-lived objects (deltas and events waiting a few
    milliseconds for their stream's turn) outlived 700-allocation young collections, were
    promoted, and set off about 23 full collections per run of the gateway load benchmark,
    170 ms each on average and up to 500 ms, during which the event loop noticed no client's
    disconnect: the p99 of a cancel's engine steps was 3 to 21 over six runs (issue #42). With
    10,000, two runs had no full collection over 5 ms, young ones under 60 ms, and peak RSS
    127-129 MB against 123. The older generations keep their thresholds."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, middle, old)


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
    tune_gc()
    uvicorn.Server(server_config(app, settings)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
