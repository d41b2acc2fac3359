"""``python -m fmha.bench``: the same as ``fmha bench``."""

import sys

from fmha.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
