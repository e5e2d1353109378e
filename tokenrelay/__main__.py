"""``python -m tokenrelay``: the same command line as the ``tokenrelay`` script (tokenrelay/cli.py)."""

from tokenrelay.cli import console

if __name__ == "__main__":
    console()
