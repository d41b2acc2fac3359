"""``python -m fmha.tools.bench``: the same as ``fmha bench``."""

import sys

from fmha.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
