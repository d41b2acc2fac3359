"""fmha's on-disk cache directory and crash-safe JSON files in it."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path


def cache_dir() -> Path:
    """``$FMHA_CACHE_DIR``, else ``~/.cache/fmha``."""
    override = os.environ.get("FMHA_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "fmha"


def read_json(path: Path) -> dict:
    """The file's object, or ``{}`` when it is missing; a corrupt file is ignored with a warning."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warnings.warn(f"fmha: ignoring unreadable cache file {path}: {error}", stacklevel=2)
        return {}
    if not isinstance(data, dict):
        warnings.warn(f"fmha: ignoring cache file {path}: not a JSON object", stacklevel=2)
        return {}
    return data


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``.

    Readers see the old file or the new one, never a partial write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1, sort_keys=True)
            file.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
