"""``python -m producer_sdk``: see producer_sdk/cli.py."""

import sys

from producer_sdk.cli import main
from protocol.settings import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
