"""The on-disk tuning cache: ``$FMHA_CACHE_DIR/tuning.json`` (default ``~/.cache/fmha``).

Layout: ``{"format": FORMAT, "entries": {device key: {shape key: record}}}`` where a record
is a config plus how it was measured. Writes are atomic (temporary file + rename) and
serialised by an advisory lock, so concurrent tuners neither corrupt the file nor lose each
other's entries. A corrupt or foreign-format file is ignored with a warning and rewritten.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from ..backends.gluon_sm90.schedule import HopperSchedule
from ..backends.triton.config import ForwardConfig
from ..cache import cache_dir, read_json, write_json_atomic

FORMAT = "fmha-tuning/1"
CACHE_FILE = "tuning.json"

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: atomic rename still protects the file
    fcntl = None


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def config_to_record(config: ForwardConfig, **measured) -> dict:
    return {"block_m": config.block_m, "block_n": config.block_n, "num_warps": config.num_warps,
            "num_stages": config.num_stages, **measured}


def record_to_config(record: dict, config_class: type[ForwardConfig] = ForwardConfig) -> ForwardConfig | None:
    """The config of a record (``BackwardConfig`` for ``bwd`` keys); ``None`` when it is incomplete or invalid.

    Fields other than the tile sizes (how it was measured) are ignored.
    """
    try:
        return config_class(int(record["block_m"]), int(record["block_n"]), int(record["num_warps"]),
                            int(record["num_stages"]))
    except (KeyError, TypeError, ValueError):
        return None


def schedule_to_record(schedule, **measured) -> dict:
    return {"kernel": schedule.backend, **schedule.to_record(), **measured}


def record_to_schedule(record: dict):
    """The Hopper schedule of a ``"kernel": "gluon_sm90"`` record; ``None`` when it is invalid."""
    try:
        return HopperSchedule.from_record(record)
    except (TypeError, ValueError):
        return None


def load(path: Path | None = None) -> dict[str, dict[str, dict]]:
    """Entries of a valid cache file; ``{}`` (with a warning) for a corrupt or foreign one."""
    path = path or cache_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # re-warned below with the fmha-specific reason
        data = read_json(path)
    if not data:
        if path.exists():
            warnings.warn(f"fmha: the tuning cache {path} is unreadable; ignoring it (it is rewritten "
                          "on the next store)", stacklevel=2)
        return {}
    if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        warnings.warn(f"fmha: the tuning cache {path} has format {data.get('format')!r}, not {FORMAT!r}; "
                      "ignoring it (it is rewritten on the next store)", stacklevel=2)
        return {}
    return {device: shapes for device, shapes in data["entries"].items() if isinstance(shapes, dict)}


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(device: str, records: dict[str, dict], path: Path | None = None) -> None:
    """Merge ``records`` (shape key text -> record) into the cache under ``device``."""
    path = path or cache_path()
    with _locked(path), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a bad file was reported by load(); here it is replaced
        entries = load(path)
        entries.setdefault(device, {}).update(records)
        write_json_atomic(path, {"format": FORMAT, "entries": entries})


