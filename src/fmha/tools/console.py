"""The rich console every ``fmha`` command prints through."""

from __future__ import annotations

import os
import sys

from rich.console import Console

# Without a terminal rich falls back to 80 columns and wraps every table row; logs (CI, device
# runs) read better with whole lines.
LOG_WIDTH = 320


def make_console() -> Console:
    """A terminal keeps its own width; a pipe or file gets LOG_WIDTH and unwrapped text, unless COLUMNS is set."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=LOG_WIDTH, soft_wrap=True)
