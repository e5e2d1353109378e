"""``tokenrelay``: see producer_sdk/cli/main.py."""

import sys

from tokenrelay.producer_sdk.cli.main import main
from tokenrelay.protocol.settings import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
