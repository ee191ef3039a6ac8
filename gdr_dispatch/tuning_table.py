"""Tuning tables: one YAML file per device, keyed by `Problem.table_key()`.

Two places are read, the user's first:
  * the user table directory, `$GDR_TUNING_CACHE` (default `~/.cache/gdr_dispatch/`,
    under `$XDG_CACHE_HOME` when set; env.py), where the autotuner and `gdr-dispatch tune` write;
  * the tables shipped in the package (`gdr_dispatch.tuning_cache`), read-only.

A key is `<problem>|<library versions>`. A lookup takes the exact key first; failing that,
an entry for the same problem measured under other library versions (newest first), so
that a patch release of torch or Triton does not throw the shipped table away; failing that,
the same shape measured with other optional inputs (`OPTIONAL_INPUT_FLAGS`).

Each entry keeps every candidate's median time or the reason it was unsupported or failed,
and the winner, so a table explains itself. Tables are user-editable data: a file that
cannot be read or parsed, or an entry of the wrong form, is reported once (per file
version) and ignored, never a crash. Writers take an exclusive `flock` on a lock file beside
the table, re-read it, merge, write a temporary file and rename it over the table: one
process per GPU can tune at once, and a reader never sees half a file; a temporary file left by
a writer that was killed is removed by the next writer (it holds the lock, so no other writer
can be using one). The next write sets an unusable table aside as `<name>.corrupt-<time>`
(never over an earlier one). YAML is read and written with libyaml's C loader where PyYAML has
it (a 10k-entry table: 1.8 s instead of 10.8 s to read).

Format 3 names the warp-specialised TileLang backend `tilelang_fused`. A format-2 table is read
as format 3: its `tilelang_ws` (and `tilelang_ws@split<n>`) become `tilelang_fused`, and its
`tilelang_fused`, the retired plain kernel, is dropped (logged once per file).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Iterator, Optional

import yaml

from . import caches, env

log = logging.getLogger("gdr_dispatch")

#: 3: keys `<problem>|<versions>` with bucketed sizes; `tilelang_fused` is the warp-specialised
#: kernel (format 2 called it `tilelang_ws`, and its `tilelang_fused` was the retired plain one).
FORMAT_VERSION = 3
READABLE_FORMATS = (2, 3)
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_BaseDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def user_table_dir() -> Path:
    return env.user_table_dir()


def shipped_table_dir() -> Path:
    from . import tuning_cache  # the package directory holding the shipped *.yaml

    return Path(tuning_cache.__file__).resolve().parent


def table_path(directory: Path, slug: str) -> Path:
    return Path(directory) / f"{slug}.yaml"


def split_key(key: str) -> tuple[str, str]:
    """`<problem>|<versions>` -> (problem, versions)."""
    problem, _, versions = key.rpartition("|")
    return problem, versions


_warned = caches.memo("table warnings", limit=256)
_cache = caches.memo("tables", limit=16)  # path -> (stamp, entries, problem index)


def forget() -> None:
    """Drop cached tables and the record of warnings already given."""
    _cache.clear()
    _warned.clear()


def _warn_once(tag, msg: str, *args) -> None:
    if tag not in _warned:
        _warned[tag] = True
        log.warning(msg, *args)


#: Format 2's name of the warp-specialised backend.
LEGACY_WS = "tilelang_ws"
RENAMED_WS = "tilelang_fused"


def _legacy_name(name):
    """A format-2 candidate name in format 3 (None: the retired plain kernel)."""
    if not isinstance(name, str):
        return name
    base, mark, n = name.partition("@")
    if base == RENAMED_WS:
        return None
    if base == LEGACY_WS:
        return RENAMED_WS + mark + n
    return name


def _migrate(entries: dict) -> tuple[dict, bool]:
    """Format-2 entries in format 3's names; whether any name changed."""
    out, changed = {}, False
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            out[key] = entry
            continue
        entry = dict(entry)
        cands = entry.get("candidates")
        if isinstance(cands, dict):
            renamed = {}
            for name, c in cands.items():
                new = _legacy_name(name)
                changed |= new != name
                if new is not None:
                    renamed[new] = c
            entry["candidates"] = renamed
        if "winner" in entry and isinstance(entry["winner"], str):
            new = _legacy_name(entry["winner"])
            changed |= new != entry["winner"]
            entry["winner"] = new
        out[key] = entry
    return out, changed


def entry_problem(key, entry) -> Optional[str]:
    """Why a table entry cannot be used as written, or None when it can."""
    if not isinstance(key, str) or "|" not in key:
        return f"its key {key!r} is not a gdr_dispatch table key"
    if not isinstance(entry, dict):
        return f"expected a mapping, got {type(entry).__name__}"
    winner = entry.get("winner")
    if winner is not None and not isinstance(winner, str):
        return f"winner: expected a backend name, got {winner!r}"
    cands = entry.get("candidates", {})
    if not isinstance(cands, dict):
        return f"candidates: expected a mapping of backend name to result, got {type(cands).__name__}"
    for name, result in cands.items():
        if not isinstance(result, dict):
            return f"candidates.{name}: expected a mapping (ms, failed or unsupported), got {result!r}"
        ms = result.get("ms")
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, Real)):
            return f"candidates.{name}.ms: expected a number, got {ms!r}"
    return None


def _read_entries(path: Path) -> dict:
    """Raw entries of one table file; {} when absent; raises ValueError when unusable as a whole."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ValueError(f"cannot read: {e}") from e
    try:
        doc = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {str(e).splitlines()[0]}") from e
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", {}), dict):
        raise ValueError("expected a mapping with an 'entries' mapping")
    fmt = doc.get("format", FORMAT_VERSION)
    if fmt not in READABLE_FORMATS:
        raise ValueError(f"format {fmt!r}, this gdr_dispatch reads formats {', '.join(map(str, READABLE_FORMATS))} "
                         f"(re-run `gdr-dispatch tune`)")
    entries = doc.get("entries") or {}
    if fmt == 2:
        entries, changed = _migrate(entries)
        if changed:
            _warn_once((path, "format 2"), "gdr_dispatch: tuning table %s is format 2: read with its %r as %r "
                       "(the warp-specialised kernel's name now) and the retired plain %r left out", path,
                       LEGACY_WS, RENAMED_WS, RENAMED_WS)
    return entries


def load_entries(path: Path) -> dict:
    """The usable entries of a table, cached per file version; what is unusable warns once."""
    return _load(path)[0]


def _load(path: Path) -> tuple[dict, dict]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}, {}
    except OSError:
        st = None
    stamp = (st.st_mtime_ns, st.st_size) if st else (0, 0)
    hit = _cache.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1], hit[2]
    try:
        raw = _read_entries(path)
    except ValueError as e:
        _warn_once((path, stamp), "gdr_dispatch: ignoring tuning table %s (%s)", path, e)
        raw = {}
    entries, index = {}, {}
    for key, entry in raw.items():
        why = entry_problem(key, entry)
        if why is not None:
            _warn_once((path, stamp, str(key)), "gdr_dispatch: ignoring entry %r of tuning table %s (%s)", key, path, why)
            continue
        entries[key] = entry
        problem, versions = split_key(key)
        index.setdefault(problem, []).append((versions, key))
    _cache[path] = (stamp, entries, index)
    return entries, index


def neighbours(problem) -> list[tuple[str, dict]]:
    """The device's table entries (user, then shipped; any library versions) for problems like
    `problem`: same device, capability, dtype, K, V, chunk size, wave bucket and `h` given or not,
    other sizes. What the autotuner prunes a table miss's candidates by (autotune.prune)."""
    return _alike(problem, same_wave=True)


def device_entries(problem) -> list[tuple[str, dict]]:
    """Every entry of the device's tables (user, then shipped; any library versions) with a winner
    and `problem`'s device, capability, dtype, K, V, chunk size and `h` mode, at any size: what
    `autotune.losing_families` reads."""
    return _alike(problem, same_wave=False)


def _alike(problem, same_wave: bool) -> list[tuple[str, dict]]:
    """The entries with a winner and `problem`'s device, capability, dtype, K, V, chunk size, `h`
    mode and direction (the op's forward entries are never a backward's neighbours); `same_wave`:
    also its wave bucket, and not `problem` itself."""
    mine = problem.problem_key().split("|")
    h_given = "h_given" in mine[8].split("+")
    forward = "forward" in mine[8].split("+")
    out = []
    for d in (user_table_dir(), shipped_table_dir()):
        entries, _ = _load(table_path(d, problem.device.slug))
        for key, entry in entries.items():
            parts = key.split("|")
            if len(parts) < 12 or parts[:5] != mine[:5] or parts[7] != mine[7]:
                continue
            if same_wave and (parts[9] != mine[9] or parts[:12] == mine[:12]):
                continue
            flags = parts[8].split("+")
            if ("h_given" in flags) == h_given and ("forward" in flags) == forward and entry.get("winner"):
                out.append((key, entry))
    return out


def fastest_measured(entry: dict, names) -> Optional[str]:
    """The entry's fastest candidate among `names` that was timed and did not fail; None when none
    was (what a split winner falls back to under `GDR_CP=0`)."""
    measured = {n: c["ms"] for n, c in entry.get("candidates", {}).items()
                if n in names and isinstance(c.get("ms"), (int, float)) and "failed" not in c}
    return min(measured, key=measured.get) if measured else None


def entry_programs(key: str, entry: dict) -> Optional[int]:
    """Sequences x value heads of the problem an entry was measured at (its `problem` line's `B<n>`
    or `N<n>`, its key's `H<n>`); None when either cannot be read."""
    seqs = re.match(r"[BN](\d+)\b", str(entry.get("problem", "")))
    heads = re.fullmatch(r"H(\d+)", key.split("|")[5]) if len(key.split("|")) > 5 else None
    return int(seqs.group(1)) * int(heads.group(1)) if seqs and heads else None


@dataclass(frozen=True)
class TableHit:
    entry: dict
    path: Path
    key: str
    exact: bool  # measured with the running library versions and the call's optional inputs
    measured_with: str  # the versions part of the key
    running: str = ""  # the running versions (same form)
    optional_note: str = ""  # how the entry's optional inputs differ from the call's ("" where they do not)

    @property
    def versions_note(self) -> str:
        """`measured with triton 3.6.0, running 3.7.1` for the libraries that differ, after how the
        entry's optional inputs differ from the call's where they do."""
        then = dict(kv.split("=", 1) for kv in self.measured_with.split(",") if "=" in kv)
        now = dict(kv.split("=", 1) for kv in self.running.split(",") if "=" in kv)
        libs = [k for k in {**then, **now} if then.get(k) != now.get(k)]
        if not libs:
            return self.optional_note or f"measured with {self.measured_with}"
        if len(libs) == 1 and libs[0] in then and libs[0] in now:
            note = f"measured with {libs[0]} {then[libs[0]]}, running {now[libs[0]]}"
        else:  # an optional library (registry.OPTIONAL_LIBS) is in a key only when installed
            was = " and ".join(f"with {k} {then[k]}" if k in then else f"without {k}" for k in libs)
            now_ = ", ".join(f"{k} {now[k]}" if k in now else f"without {k}" for k in libs)
            note = f"measured {was}, running {now_}"
        return f"{self.optional_note}; {note}" if self.optional_note else note


#: The flags of a problem key for inputs a call may leave out whose presence moves no backend's
#: speed by much (one state read or write per sequence and head): an entry that differs from the
#: call only in them is its shape's measurement, taken after the exact key (`lookup`). The model
#: grids (tools/tune_models_*.yaml) are tuned with both present; training calls pass neither.
OPTIONAL_INPUT_FLAGS = ("has_dht", "has_initial_state")


def _without_optional_inputs(problem_key: str) -> tuple[str, frozenset]:
    """The problem key with `OPTIONAL_INPUT_FLAGS` left out of its flags, and those it had."""
    parts = problem_key.split("|")
    if len(parts) < 9:
        return problem_key, frozenset()
    flags = parts[8].split("+")
    kept = [f for f in flags if f not in OPTIONAL_INPUT_FLAGS]
    parts[8] = "+".join(kept) or "none"
    return "|".join(parts), frozenset(f for f in flags if f in OPTIONAL_INPUT_FLAGS)


def _optional_note(entry_has: frozenset, call_has: frozenset) -> str:
    words = {"has_dht": "dht", "has_initial_state": "initial_state"}
    parts = [f"with {words[f]}" for f in sorted(entry_has - call_has)]
    parts += [f"without {words[f]}" for f in sorted(call_has - entry_has)]
    return "measured " + " and ".join(parts) + " (the same shape otherwise)"


def lookup(slug: str, problem_key: str, versions_key: str) -> Iterator[TableHit]:
    """Entries for a problem, best first: the exact key (user table, then shipped), then the
    same problem under other library versions (user table, then shipped; newest first), then the
    same shape measured with other optional inputs (`OPTIONAL_INPUT_FLAGS`; running versions
    first, then newest first)."""
    tables = [table_path(d, slug) for d in (user_table_dir(), shipped_table_dir())]
    exact_key = f"{problem_key}|{versions_key}"
    for path in tables:
        entry = load_entries(path).get(exact_key)
        if entry is not None and entry.get("winner"):
            yield TableHit(entry, path, exact_key, True, versions_key, versions_key)
    for path in tables:
        entries, index = _load(path)
        others = [(v, k) for v, k in index.get(problem_key, []) if v != versions_key and entries[k].get("winner")]
        others.sort(key=lambda vk: str(entries[vk[1]].get("measured_at", "")), reverse=True)
        for versions, key in others:
            yield TableHit(entries[key], path, key, False, versions, versions_key)
    bare, mine = _without_optional_inputs(problem_key)
    for path in tables:
        entries, index = _load(path)
        alike = []
        for problem, rows in index.items():
            if problem == problem_key:
                continue
            other_bare, theirs = _without_optional_inputs(problem)
            if other_bare == bare:
                alike += [(v, k, theirs) for v, k in rows if entries[k].get("winner")]
        # running versions first, then the fewest flags apart, then the newest
        alike.sort(key=lambda vkt: (vkt[0] == versions_key, -len(vkt[2] ^ mine),
                                    str(entries[vkt[1]].get("measured_at", ""))), reverse=True)
        for versions, key, theirs in alike:
            yield TableHit(entries[key], path, key, False, versions, versions_key,
                           _optional_note(theirs, mine) if theirs != mine else "")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _set_aside(path: Path) -> Path:
    """Move an unusable table to a fresh `<name>.corrupt-<UTC time>[-n]` beside it."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, aside)
    return aside


def _file_mode(path: Path) -> int:
    """The mode a rewritten table gets: the old file's, else what the umask allows of 0o666
    (mkstemp's 0o600 would hide a shared cache directory's table from its other users)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class _PlainDumper(_BaseDumper):
    """Writes every entry in full: an entry derived for machines without an optional peer
    shares its candidates' dicts with the measured one, which the safe dumper would print as
    `&id001` anchors and `*id001` aliases (valid, but unreadable in a table people diff)."""

    def ignore_aliases(self, data):
        return True


def record(slug: str, device_name: str, new_entries: dict, directory: Optional[Path] = None) -> Path:
    """Merge `new_entries` into the device's table in `directory` (default: the user table)."""
    path = table_path(directory or user_table_dir(), slug)
    with _locked(path):
        for stale in path.parent.glob(path.name + ".*.tmp"):  # a killed writer's (we hold the lock)
            with contextlib.suppress(OSError):
                stale.unlink()
        try:
            entries = dict(_read_entries(path))
        except ValueError as e:
            aside = _set_aside(path)
            log.warning("gdr_dispatch: tuning table %s is unusable (%s); moved to %s", path, e, aside)
            entries = {}
        entries.update(new_entries)
        doc = {
            "format": FORMAT_VERSION,
            "device": device_name,
            "note": "written by gdr_dispatch; keys are <problem>|<library versions>; candidates hold median ms, "
                    "or why a backend was unsupported or failed",
            "entries": dict(sorted(entries.items(), key=lambda kv: str(kv[0]))),
        }
        mode = _file_mode(path)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                yaml.dump(doc, f, Dumper=_PlainDumper, sort_keys=False, width=120)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    _cache.pop(path, None)
    return path


def without_optional(key: str, entry: dict, needs: dict) -> dict:
    """The entries a tune with optional libraries installed also writes for users without
    them: for each library `lib` in the key's versions, `needs[lib]` names the backends that
    need it; their candidates (and `<backend>@split<n>`) are marked absent and the winner is the
    fastest candidate left, under the key without `lib` (`versions_key` leaves an absent
    optional library out). Same measurement, so no second sweep; `derived_from` says which."""
    from .registry import base_name

    problem, versions = split_key(key)
    items = versions.split(",")
    out = {}
    for lib, names in needs.items():
        mine = [v for v in items if v.startswith(f"{lib}=")]
        if not mine:
            continue
        candidates = {}
        for name, c in entry.get("candidates", {}).items():
            candidates[name] = {"unsupported": f"{lib} not installed"} if base_name(name) in names else c
        timed = {n: c["ms"] for n, c in candidates.items()
                 if isinstance(c.get("ms"), Real) and "failed" not in c and "unsupported" not in c}
        if not timed:
            continue
        out[f"{problem}|{','.join(v for v in items if v not in mine)}"] = {
            **entry, "winner": min(timed, key=timed.get), "candidates": candidates, "derived_from": key}
    return out


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
