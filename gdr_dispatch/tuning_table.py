"""Tuning tables: one YAML file per device, keyed by `Problem.table_key()`.

Two places are read, the user's first:
  * the user table directory, `$GDR_TUNING_CACHE` (default `~/.cache/gdr_dispatch/`,
    under `$XDG_CACHE_HOME` when set), where the autotuner and `gdr-dispatch tune` write;
  * the tables shipped in the package (`gdr_dispatch.tuning_cache`), read-only.

Each entry keeps every candidate's median time or the reason it was unsupported or failed,
and the winner, so a table explains itself. Writers take an exclusive `flock` on a lock file
beside the table, re-read it, merge, write a temporary file and rename it over the table:
one process per GPU can tune at once, and a reader never sees half a file. A table that
cannot be read or parsed is reported once (per file version) and ignored, never a crash;
the next write sets it aside as `<name>.corrupt` and starts a fresh one.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import yaml

log = logging.getLogger("gdr_dispatch")

FORMAT_VERSION = 1


def user_table_dir() -> Path:
    env = os.environ.get("GDR_TUNING_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdr_dispatch"


def shipped_table_dir() -> Path:
    from . import tuning_cache  # the package directory holding the shipped *.yaml

    return Path(tuning_cache.__file__).resolve().parent


def table_path(directory: Path, slug: str) -> Path:
    return Path(directory) / f"{slug}.yaml"


_warned: set = set()
_cache: dict[Path, tuple[tuple[int, int], dict]] = {}


def forget() -> None:
    """Drop cached tables and the record of warnings already given."""
    _cache.clear()
    _warned.clear()


def _read_entries(path: Path) -> dict:
    """Entries of one table file; {} when absent; raises ValueError when unusable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ValueError(f"cannot read: {e}") from e
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {str(e).splitlines()[0]}") from e
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", {}), dict):
        raise ValueError("expected a mapping with an 'entries' mapping")
    if doc.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        raise ValueError(f"format {doc.get('format')!r}, this gdr_dispatch reads format {FORMAT_VERSION}")
    return doc.get("entries") or {}


def load_entries(path: Path) -> dict:
    """Entries of a table, cached per file version; an unusable table warns once and reads as empty."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    except OSError:
        st = None
    stamp = (st.st_mtime_ns, st.st_size) if st else (0, 0)
    hit = _cache.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        entries = _read_entries(path)
    except ValueError as e:
        if (path, stamp) not in _warned:
            _warned.add((path, stamp))
            log.warning("gdr_dispatch: ignoring tuning table %s (%s)", path, e)
        entries = {}
    _cache[path] = (stamp, entries)
    return entries


def lookup(slug: str, key: str) -> Optional[tuple[dict, Path]]:
    """The entry for `key` and the table it came from: user table first, then shipped."""
    for directory in (user_table_dir(), shipped_table_dir()):
        path = table_path(directory, slug)
        entry = load_entries(path).get(key)
        if isinstance(entry, dict) and entry.get("winner"):
            return entry, path
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def record(slug: str, device_name: str, new_entries: dict, directory: Optional[Path] = None) -> Path:
    """Merge `new_entries` into the device's table in `directory` (default: the user table)."""
    path = table_path(directory or user_table_dir(), slug)
    with _locked(path):
        try:
            entries = dict(_read_entries(path))
        except ValueError as e:
            aside = path.with_name(path.name + ".corrupt")
            log.warning("gdr_dispatch: tuning table %s is unusable (%s); moved to %s", path, e, aside)
            os.replace(path, aside)
            entries = {}
        entries.update(new_entries)
        doc = {
            "format": FORMAT_VERSION,
            "device": device_name,
            "note": "written by gdr_dispatch; candidates hold median ms, or why a backend was unsupported or failed",
            "entries": dict(sorted(entries.items())),
        }
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(doc, f, sort_keys=False, width=120)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    _cache.pop(path, None)
    return path


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
