"""``python -m producer_sdk``: see producer_sdk/cli.py."""

import sys

from producer_sdk.cli import main

if __name__ == "__main__":
    sys.exit(main())
