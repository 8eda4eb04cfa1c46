"""Tuning profiles on disk: every trial the tuner measured and the best config, per hardware x model.

One SQLite file (``$TUNELAB_HOME/profiles.sqlite``) is shared by every job on the host.  Several
jobs may tune at once and any of them may be killed, so every write is one short transaction in
WAL mode with a busy timeout: concurrent writers queue instead of failing, and a killed writer
loses only the transaction it had not finished.  A file the store does not understand (corrupt,
foreign, or written by a newer tunelab) is refused with ``StoreError`` and never modified.

What only reads (a job's lookup, ``profiles list/show/export``) opens the file read-only, so a store
baked into a container image or shared site-wide read-only loads and lists: where SQLite cannot make
the WAL's side files in a directory it may not write, the file is read as it is (``immutable``).
"""

from __future__ import annotations

import copy
import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from .errors import StoreError, StoreLocationError
from .profile_export import (  # (InvalidExport: importable from here too, where it began)
    EXPORT_FORMAT,
    EXPORT_VERSION,
    PHASES,
    InvalidExport,
    validate_export,
)
from .profile_records import (  # (DamagedProfileError: importable from here too, where it began)
    Best,
    DamagedProfileError,
    ImportResult,
    ProfileKey,
    ProfileSummary,
    Trial,
    best_from_row,
    damaged,
    damaged_summary,
    stored_count,
    stored_number,
    stored_object,
    summary_from_row,
    to_json,
    trial_from_row,
)

SCHEMA_VERSION = 3  # 2: the best config carries its gain interval, steps to lock and outcome;
                    # 3: and the tuner's gain estimate, the point its interval is around
FILE_NAME = "profiles.sqlite"
BUSY_TIMEOUT_S = 60.0
_SQLITE_MAGIC = b"SQLite format 3\x00"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS profiles (
    id INTEGER PRIMARY KEY,
    hardware_hash TEXT NOT NULL, model_signature TEXT NOT NULL, framework TEXT NOT NULL,
    world_size INTEGER NOT NULL, hardware_name TEXT NOT NULL, hardware_facts TEXT NOT NULL,
    model_name TEXT NOT NULL, created TEXT NOT NULL, updated TEXT NOT NULL,
    UNIQUE (hardware_hash, model_signature, framework, world_size));
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY, uid TEXT NOT NULL UNIQUE,
    profile_id INTEGER NOT NULL REFERENCES profiles(id) ON DELETE CASCADE,
    knobs TEXT NOT NULL, score REAL NOT NULL, spread REAL NOT NULL, steps INTEGER NOT NULL,
    seconds REAL NOT NULL, run_id TEXT NOT NULL, phase TEXT NOT NULL, created TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS trials_by_profile ON trials (profile_id, id);
CREATE TABLE IF NOT EXISTS best (
    profile_id INTEGER PRIMARY KEY REFERENCES profiles(id) ON DELETE CASCADE,
    knobs TEXT NOT NULL, score REAL NOT NULL, default_score REAL NOT NULL, spread REAL NOT NULL,
    run_id TEXT NOT NULL, updated TEXT NOT NULL,
    gain_low REAL, gain_high REAL, steps INTEGER, outcome TEXT, gain REAL)
"""
# What later versions added to the best table (an older file gains them when opened: nothing is lost,
# the bests it holds have them empty): version 2 the interval, steps and outcome, version 3 the estimate.
_ADDED_BEST_COLUMNS = (("gain_low", "REAL"), ("gain_high", "REAL"), ("steps", "INTEGER"), ("outcome", "TEXT"),
                       ("gain", "REAL"))
_BEST_COLUMNS = ("profile_id, knobs, score, default_score, spread, run_id, updated, gain_low, gain_high, steps, "
                 "outcome, gain")
_BEST_SLOTS = ", ".join("?" * len(_BEST_COLUMNS.split(",")))

_SUMMARY_SQL_OF = """
SELECT p.*, (SELECT COUNT(*) FROM trials t WHERE t.profile_id = p.id) AS n_trials,
       b.score AS best_score, {gain} AS best_gain
FROM profiles p LEFT JOIN best b ON b.profile_id = p.id
"""
_SUMMARY_SQL = _SUMMARY_SQL_OF.format(gain="CASE WHEN b.gain IS NULL THEN b.score / b.default_score "
                                           "WHEN typeof(b.gain) IN ('real', 'integer') THEN b.gain END")
# An older store read as it is (no gain column): every best's gain is its ratio of means.
_OLDER_SUMMARY_SQL = _SUMMARY_SQL_OF.format(gain="b.score / b.default_score")
_KEY_WHERE = "hardware_hash = ? AND model_signature = ? AND framework = ? AND world_size = ?"


class ProfileStore:
    """The profile store at ``path`` (default ``tunelab_home() / "profiles.sqlite"``).

    Each call opens its own connection, so a store object is safe to use from forked children and
    threads; opening is cheap next to a tuning trial.
    """

    def __init__(self, path: Path | str | None = None, create: bool = True) -> None:
        """``create=False``: for commands that only read; where no store exists yet, it reads as an empty
        one and nothing is created on disk (a write then creates it)."""
        if path is None:
            from .config import tunelab_home

            path = tunelab_home() / FILE_NAME
        self.path = Path(path)
        self.busy_timeout_s = BUSY_TIMEOUT_S  # how long a write waits for another process's lock
        self._absent = False  # no file yet, and opened to read: reads see an empty store in memory
        self._older = False   # an older schema, opened to read: read as it is, upgraded by the first write
        self._immutable = False  # reads find no way to share the WAL (a read-only directory): the file as it is
        self._open_or_create(create)

    # -- writes (each one transaction) ---------------------------------------------------------

    def upsert_profile(self, key: ProfileKey, hardware_name: str, hardware_facts: dict,
                       model_name: str) -> int:
        """The id of ``key``'s profile, created if new (names and facts are refreshed if not)."""
        now = _now()
        with self._write() as conn:
            row = conn.execute(f"SELECT id FROM profiles WHERE {_KEY_WHERE}", key.params()).fetchone()
            if row is None:
                return _insert_profile(conn, key.params(), str(hardware_name), to_json(hardware_facts),
                                       str(model_name), now, now)
            conn.execute("UPDATE profiles SET hardware_name = ?, hardware_facts = ?, model_name = ?, updated = ?"
                         " WHERE id = ?", (str(hardware_name), to_json(hardware_facts), str(model_name), now, row[0]))
            return int(row[0])

    def record_trial(self, profile_id: int, knobs: dict, score: float, spread: float, steps: int,
                     seconds: float, run_id: str, phase: str) -> int:
        """Store one measured config; returns the trial id.  Its uid keeps re-imports from duplicating it."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        row = (uuid.uuid4().hex, int(profile_id), to_json(knobs), stored_number("score", score),
               stored_number("spread", spread), stored_count("steps", steps), stored_number("seconds", seconds),
               str(run_id), phase, _now())
        with self._write() as conn:
            self._touch(conn, row[1], row[-1])
            cur = conn.execute("INSERT INTO trials (uid, profile_id, knobs, score, spread, steps, seconds,"
                               " run_id, phase, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            return int(cur.lastrowid)

    def set_best(self, profile_id: int, knobs: dict, score: float, default_score: float, spread: float,
                 run_id: str, gain_interval: tuple[float, float, float] | None = None, steps: int | None = None,
                 outcome: str | None = None) -> None:
        """Replace the profile's best config (what the next run of this key starts from), with the
        tuner's gain (estimate, low, high), the steps it took and its outcome when known.  The estimate
        is the tuner's (paired with the default's blocks), not ``score / default_score``: under drift the
        two means can differ from it by more than the interval's width."""
        default = stored_number("default_score", default_score)
        if default <= 0:
            raise ValueError(f"default_score must be > 0, got {default_score!r}")
        gain = low = high = None
        if gain_interval is not None:
            gain, low, high = (stored_number(name, v) for name, v in zip(("gain", "gain_low", "gain_high"),
                                                                          gain_interval, strict=True))
            if not 0 < low <= gain <= high:
                raise ValueError(f"gain {gain!r} lies outside its interval [{low!r}, {high!r}], or that is not > 0")
        now = _now()
        row = (int(profile_id), to_json(knobs), stored_number("score", score), default,
               stored_number("spread", spread), str(run_id), now, low, high,
               None if steps is None else stored_count("steps", steps), None if outcome is None else str(outcome),
               gain)
        with self._write() as conn:
            self._touch(conn, row[0], now)
            conn.execute(f"INSERT OR REPLACE INTO best ({_BEST_COLUMNS}) VALUES ({_BEST_SLOTS})", row)

    def rekey(self, profile_id: int, key: ProfileKey) -> None:
        """Store a profile under ``key`` (the same hardware and model's, as a newer tunelab computes the
        hardware hash and the model signature); its trials and best stay as they are."""
        now = _now()
        with self._write() as conn:
            self._touch(conn, int(profile_id), now)
            conn.execute("UPDATE profiles SET hardware_hash = ?, model_signature = ?, framework = ?, world_size = ?"
                         " WHERE id = ?", (*key.params(), int(profile_id)))

    def delete(self, profile_id: int) -> bool:
        """Remove a profile with its trials and best; False if there was no such profile."""
        with self._write() as conn:
            conn.execute("DELETE FROM trials WHERE profile_id = ?", (profile_id,))
            conn.execute("DELETE FROM best WHERE profile_id = ?", (profile_id,))
            return conn.execute("DELETE FROM profiles WHERE id = ?", (profile_id,)).rowcount > 0

    # -- reads ---------------------------------------------------------------------------------

    def best(self, key: ProfileKey) -> Best | None:
        with self._connect() as conn:
            row = conn.execute("SELECT b.* FROM best b JOIN profiles p ON p.id = b.profile_id"
                               f" WHERE {_KEY_WHERE}",
                               key.params()).fetchone()
        return None if row is None else best_from_row(row, self.path)

    def best_of(self, profile_id: int) -> Best | None:
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM best WHERE profile_id = ?", (profile_id,)).fetchone()
        return None if row is None else best_from_row(row, self.path)

    def trials(self, profile_id: int) -> list[Trial]:
        """The profile's trials in the order they were recorded."""
        with self._connect() as conn:
            rows = conn.execute("SELECT * FROM trials WHERE profile_id = ? ORDER BY id", (profile_id,))
            return [trial_from_row(r, self.path) for r in rows.fetchall()]

    def profiles(self, with_damaged: bool = False) -> list[ProfileSummary]:
        """Every profile that can be read, in id order.  A damaged row (``get`` of its id says what is
        damaged) is left out, so that one row cannot stop the use of the others; ``with_damaged``: it is
        listed too, as a summary whose ``damage`` says why (its unreadable fields None)."""
        return self._summaries("ORDER BY p.id", (), "mark" if with_damaged else "skip")

    def get(self, profile_id: int) -> ProfileSummary | None:
        """The profile's summary; :class:`DamagedProfileError` where its row cannot be read."""
        found = self._summaries("WHERE p.id = ?", (profile_id,))
        return found[0] if found else None

    def id_of(self, key: ProfileKey) -> int | None:
        """The id of the profile stored under ``key`` (found by its key: no other row is read)."""
        with self._connect() as conn:
            row = conn.execute(f"SELECT id FROM profiles WHERE {_KEY_WHERE}", key.params()).fetchone()
        return None if row is None else int(row[0])

    def nearest(self, key: ProfileKey, hardware_facts: dict | None = None,
                also: tuple[str, ...] = ()) -> ProfileSummary | None:
        """Another profile of the same model and framework to seed ``key``'s tuning from.

        Prefers the same world size, then the hardware sharing the most facts with ``hardware_facts``
        (by default the facts stored for ``key.hardware_hash``, if any profile has them), then a
        profile with a best config and many trials.  ``also``: other signatures of the same model (its
        key before a change of how signatures are computed).
        """
        candidates = [s for sig in dict.fromkeys((key.model_signature, *also))  # (damaged rows left out)
                      for s in self._summaries("WHERE p.model_signature = ? AND p.framework = ?", (sig, key.framework),
                                               "skip")
                      if s.key != key]
        if not candidates:
            return None
        facts = hardware_facts if hardware_facts is not None else self._facts_of(key.hardware_hash)

        def rank(s: ProfileSummary) -> tuple:
            return (s.world_size == key.world_size, s.hardware_hash == key.hardware_hash,
                    _equal_facts(facts, s.hardware_facts), -abs(s.world_size - key.world_size),
                    s.best_score is not None, s.n_trials, s.updated)
        return max(candidates, key=rank)

    # -- export / import -----------------------------------------------------------------------

    def export(self, profile_ids: list[int] | None = None) -> dict:
        """Profiles (all by default, else those of ``profile_ids``, and only those read) with trials and
        best, as JSON-able data for ``import_``.  A damaged profile among them is DamagedProfileError."""
        if profile_ids is None:
            try:
                summaries = self._summaries("ORDER BY p.id", ())
            except DamagedProfileError as exc:
                raise DamagedProfileError(f"{exc} (the other profiles can be exported by id)") from None
        else:
            summaries = []
            for i in dict.fromkeys(profile_ids):
                found = self.get(i)
                if found is None:
                    raise StoreError(f"no profile with id {i} in {self.path}")
                summaries.append(found)
        profiles = [self._export_one(s) for s in summaries]
        # the oldest version that holds them: a tunelab from before retune checks reads an export without
        # one (version 1), and one with them says it is newer, rather than that a trial's phase is wrong
        checks = any(t.get("phase") == "check" for p in profiles for t in p.get("trials", []))
        out = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION if checks else 1, "profiles": profiles}
        for s, p in zip(summaries, out["profiles"]):
            # a backup that `profiles import` would refuse is no backup: each profile is read as import
            # reads it (a trial dated in the future by a host's wrong clock, a field edited in the file)
            try:
                validate_export({**out, "profiles": [copy.deepcopy(p)]})
            except InvalidExport as exc:
                where = str(exc).replace("profiles[0].", "").replace("profiles[0]", "the profile")
                raise StoreError(f"profile {s.id} cannot be exported as `profiles import` would read it back: "
                                 f"{where} (the others can be, by id)") from None
        return out

    def import_(self, data: dict) -> list[int]:
        """Merge an export into this store; returns the ids of the profiles it names."""
        return self.merge(data).profile_ids

    def merge(self, data: dict) -> ImportResult:
        """Merge an export in one transaction: trials already here (same uid) are skipped and a
        profile's best is replaced only by a higher score.  Malformed data raises :class:`~.profile_export.InvalidExport`."""
        profiles = validate_export(data)
        ids: list[int] = []
        added_profiles = added_trials = 0
        with self._write() as conn:
            for p in profiles:
                pid, new = self._import_profile(conn, p)
                ids.append(pid)
                added_profiles += new
                for t in p["trials"]:
                    there = conn.execute("SELECT profile_id FROM trials WHERE uid = ?", (t["uid"],)).fetchone()
                    if there is not None and there[0] != pid:  # (the same trial again is skipped below)
                        raise InvalidExport(f"trial {t['uid']} is a trial of profile {there[0]} here, not of the "
                                            f"profile the file gives it (profile {pid} here): a copy edited by hand?")
                    added_trials += conn.execute(
                        "INSERT OR IGNORE INTO trials (uid, profile_id, knobs, score, spread, steps, seconds,"
                        " run_id, phase, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (t["uid"], pid, to_json(t["knobs"]), float(t["score"]), float(t["spread"]),
                         t["steps"], float(t["seconds"]), t["run_id"], t["phase"], t["created"])).rowcount
                if p.get("best") is not None:
                    self._import_best(conn, pid, p["best"])
        return ImportResult(ids, added_profiles, added_trials)

    # -- internals -----------------------------------------------------------------------------

    def _open_or_create(self, create: bool = True) -> None:
        """Check an existing file read-only before anything writes to it; create the schema if new
        (``create``), else leave a missing store missing."""
        try:
            folder = self.path.parent  # (or the nearest folder on its way that exists: the rest is made)
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent
            if folder.exists() and not folder.is_dir():
                raise StoreLocationError(f"cannot use profile store {self.path}: {folder} is a file, "
                                         "not a directory (is TUNELAB_HOME set to a file?)")
            if not create and not (self.path.exists() and self.path.stat().st_size > 0):
                self._absent = True
                return
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except PermissionError:  # (EACCES, EPERM; a read-only file system is OSError EROFS: below)
                raise StoreError(f"cannot create the profile store's directory {self.path.parent}: "
                                 f"{folder} is not writable") from None
            existing = self.path.exists() and self.path.stat().st_size > 0
            if existing:
                with open(self.path, "rb") as f:
                    magic = f.read(len(_SQLITE_MAGIC))
        except OSError as exc:
            raise StoreError(f"cannot use profile store {self.path}: {exc.strerror or exc}") from None
        if existing and magic != _SQLITE_MAGIC:
            raise StoreError(f"{self.path} is not a tunelab profile store (not an SQLite file; corrupt?)")
        with self._connect(write=create) as conn:
            version = self._schema_version(conn, existing)
            if version is not None and version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema version {version}, newer than this tunelab "
                                 f"supports ({SCHEMA_VERSION}); upgrade tunelab to use it")
            if version is not None and version < SCHEMA_VERSION:
                if create:
                    self._upgrade(conn)
                else:  # a job or command that only reads needs no write access to an older store
                    self._older = True
            if version is None and not create:  # an empty SQLite file: read as no store, and left as it is
                self._absent = True
                return
            if version is None:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("BEGIN IMMEDIATE")
                for statement in _SCHEMA.split(";"):
                    conn.execute(statement)
                conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                             (str(SCHEMA_VERSION),))
                conn.execute("COMMIT")

    def _upgrade(self, conn: sqlite3.Connection) -> None:
        """An older store gains the later versions' columns (empty for the bests it already holds)."""
        conn.execute("BEGIN IMMEDIATE")
        version = self._schema_version(conn, True) or 0
        if version > SCHEMA_VERSION:  # a newer tunelab upgraded it meanwhile: not ours to write
            conn.execute("ROLLBACK")
            raise StoreError(f"{self.path} has schema version {version}, newer than this tunelab "
                             f"supports ({SCHEMA_VERSION}); upgrade tunelab to use it")
        if version == SCHEMA_VERSION:  # upgraded meanwhile
            conn.execute("COMMIT")
            return
        columns = {r[1] for r in conn.execute("PRAGMA table_info(best)")}
        for name, kind in _ADDED_BEST_COLUMNS:
            if name not in columns:  # another process may have upgraded it meanwhile
                conn.execute(f"ALTER TABLE best ADD COLUMN {name} {kind}")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")

    def _schema_version(self, conn: sqlite3.Connection, existing: bool) -> int | None:
        """The file's schema version; None for an empty database (to be created)."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" not in tables:
            if existing and tables:
                raise StoreError(f"{self.path} is an SQLite file but not a tunelab profile store")
            return None
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            return int(row[0])
        except (TypeError, ValueError):
            raise StoreError(f"{self.path} has no valid schema version; not a tunelab profile store") from None

    @contextmanager
    def _connect(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        """A fresh connection; any SQLite failure becomes a one-line ``StoreError`` naming the file.  A
        store opened to read that does not exist is an empty one in memory, until some process creates it.
        Reads (not ``write``) open the file read-only: a store in a directory this process may not write
        (a site-wide one, one baked into an image) reads as any other."""
        if self._absent and self.path.exists() and self.path.stat().st_size > 0:
            self._absent = False
            self._open_or_create(create=False)  # created meanwhile: check it as any existing store
        try:
            if self._absent:
                conn = sqlite3.connect(":memory:", isolation_level=None)
                for statement in _SCHEMA.split(";"):
                    conn.execute(statement)
            elif write:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
            else:
                conn = self._reader()
        except sqlite3.Error as exc:
            raise StoreError(self._describe(exc, write)) from None
        conn.row_factory = sqlite3.Row
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            yield conn
        except sqlite3.Error as exc:
            raise StoreError(self._describe(exc, write)) from None
        finally:
            conn.close()

    def _reader(self) -> sqlite3.Connection:
        """A read-only connection (``mode=ro``).  A WAL store's readers share its ``-shm`` file, which
        SQLite makes beside the store: where it cannot (a read-only directory or file system, and no
        ``-shm`` left there), the file is opened ``immutable``, read as it is without that index."""
        uri = Path(os.path.abspath(self.path)).as_uri()
        if not self._immutable:
            conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=self.busy_timeout_s, isolation_level=None)
            try:
                conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # (the WAL index is opened here)
                return conn
            except sqlite3.Error as exc:
                conn.close()
                if not _cannot_share_wal(exc):
                    raise
            wal = Path(f"{self.path}-wal")
            if wal.exists() and wal.stat().st_size > 0:  # (read as it is, the file would lack those changes)
                raise StoreError(f"{self.path}: its write-ahead log {wal.name} holds changes that a reader cannot "
                                 "apply where it may not write (a read-only directory): open the store once where "
                                 "it is writable (`tunelab profiles list` there), or copy it after its last writer "
                                 "closed")
            self._immutable = True
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, isolation_level=None)

    def _describe(self, exc: sqlite3.Error, write: bool) -> str:
        """The one line for a failure: a write where this process may not write says so, by the place."""
        if write and _cannot_share_wal(exc):
            folder = self.path.parent
            if not os.access(folder, os.W_OK):
                return f"the profile store's directory is not writable: {folder}"
            if self.path.exists() and not os.access(self.path, os.W_OK):
                return f"the profile store is not writable (a read-only file): {self.path}"
        return _describe(self.path, exc, self.busy_timeout_s)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taking the write lock up front (waits up to ``BUSY_TIMEOUT_S``)."""
        if self._absent:  # opened to read, and now written: the store is created for real
            self._absent = False
            self._open_or_create(create=True)
        if self._older:  # opened to read an older schema, and now written: upgraded first
            with self._connect(write=True) as conn:
                self._upgrade(conn)
            self._older = False
        with self._connect(write=True) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _touch(self, conn: sqlite3.Connection, profile_id: int, now: str) -> None:
        if conn.execute("UPDATE profiles SET updated = ? WHERE id = ?", (now, profile_id)).rowcount == 0:
            raise StoreError(f"no profile with id {profile_id} in {self.path}")

    def _summaries(self, clause: str, params: tuple, damaged_rows: str = "raise") -> list[ProfileSummary]:
        """``damaged_rows``: "raise" (DamagedProfileError naming the first), "skip" or "mark" (listed with
        ``damage`` set)."""
        with self._connect() as conn:
            rows = conn.execute(f"{_OLDER_SUMMARY_SQL if self._older else _SUMMARY_SQL} {clause}", params).fetchall()
        found = []
        for r in rows:
            try:
                found.append(summary_from_row(r, self.path))
            except DamagedProfileError as exc:
                if damaged_rows == "raise":
                    raise
                if damaged_rows == "mark":
                    found.append(damaged_summary(r, str(exc)))
        return found

    def _facts_of(self, hardware_hash: str) -> dict:
        """The facts stored for this hardware (of the first profile of it whose facts can be read)."""
        with self._connect() as conn:
            rows = conn.execute("SELECT hardware_facts, id FROM profiles WHERE hardware_hash = ? ORDER BY id",
                                (hardware_hash,)).fetchall()
        for facts, pid in rows:
            try:
                return stored_object(self.path, facts, pid, "its hardware facts are")
            except DamagedProfileError:
                continue
        return {}

    def _export_one(self, s: ProfileSummary) -> dict:
        best = self.best_of(s.id)
        return {"hardware_hash": s.hardware_hash, "model_signature": s.model_signature,
                "framework": s.framework, "world_size": s.world_size, "hardware_name": s.hardware_name,
                "hardware_facts": s.hardware_facts, "model_name": s.model_name, "created": s.created,
                "updated": s.updated,
                "trials": [{k: v for k, v in vars(t).items() if k not in ("id", "profile_id")}
                           for t in self.trials(s.id)],
                "best": None if best is None else {k: v for k, v in vars(best).items()
                                                   if k not in ("profile_id", "gain", "estimate")}
                                             | ({} if best.estimate is None else {"gain": best.estimate})}

    def _import_profile(self, conn: sqlite3.Connection, p: dict) -> tuple[int, bool]:
        key = (p["hardware_hash"], p["model_signature"], p["framework"], p["world_size"])
        row = conn.execute(f"SELECT id FROM profiles WHERE {_KEY_WHERE}", key).fetchone()
        if row is not None:
            conn.execute("UPDATE profiles SET updated = MAX(updated, ?) WHERE id = ?", (p["updated"], row[0]))
            return int(row[0]), False
        return _insert_profile(conn, key, p["hardware_name"], to_json(p["hardware_facts"]), p["model_name"],
                               p["created"], p["updated"]), True

    def _import_best(self, conn: sqlite3.Connection, profile_id: int, b: dict) -> None:
        here = conn.execute("SELECT score FROM best WHERE profile_id = ?", (profile_id,)).fetchone()
        if here is not None and (isinstance(here[0], bool) or not isinstance(here[0], (int, float))):
            raise damaged(self.path, profile_id, f"the score of its best is {here[0]!r}")
        if here is not None and here[0] >= b["score"]:
            return
        conn.execute(f"INSERT OR REPLACE INTO best ({_BEST_COLUMNS}) VALUES ({_BEST_SLOTS})",
                     (profile_id, to_json(b["knobs"]), float(b["score"]), float(b["default_score"]),
                      float(b["spread"]), b["run_id"], b["updated"], b.get("gain_low"), b.get("gain_high"),
                      b.get("steps"), b.get("outcome"), b.get("gain")))


# -- helpers ---------------------------------------------------------------------------------------

def _insert_profile(conn: sqlite3.Connection, key: tuple, hardware_name: str, facts_json: str, model_name: str,
                    created: str, updated: str) -> int:
    """A new profile row under an id no profile of this file ever had: a deleted profile's id is not
    given again (SQLite would: the largest id plus one), so a run or a command that still holds an
    id writes to that profile or fails, never into another.  The highest id given is kept in meta."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'last_profile_id'").fetchone()
    given = int(row[0]) if row is not None and str(row[0]).isdigit() else 0
    highest = conn.execute("SELECT MAX(id) FROM profiles").fetchone()[0] or 0
    new_id = max(given, int(highest)) + 1
    if new_id >= 2 ** 63:  # (SQLite's integers end there: the store's ids were damaged or edited)
        raise StoreError(f"the store's profile ids have reached {new_id - 1}, past what SQLite can number: "
                         "export the profiles, delete the store and import them (they are numbered anew)")
    conn.execute("INSERT INTO profiles (id, hardware_hash, model_signature, framework, world_size, hardware_name,"
                 " hardware_facts, model_name, created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                 (new_id, *key, hardware_name, facts_json, model_name, created, updated))
    conn.execute("INSERT INTO meta (key, value) VALUES ('last_profile_id', ?)"
                 " ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(new_id),))
    return new_id


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _equal_facts(a: dict, b: dict) -> int:
    return sum(1 for k, v in a.items() if k in b and b[k] == v)


_READ_ONLY_PLACE = ("SQLITE_READONLY_DIRECTORY", "SQLITE_READONLY_CANTINIT", "SQLITE_READONLY_CANTLOCK",
                    "SQLITE_READONLY", "SQLITE_CANTOPEN")


def _cannot_share_wal(exc: sqlite3.Error) -> bool:
    """Whether SQLite failed for want of writing beside the store: the WAL's ``-shm`` it may not make,
    a directory or file it may not write (not a lock, not a damaged file)."""
    name = getattr(exc, "sqlite_errorname", None)  # (Python 3.11+)
    if name is not None:
        return name in _READ_ONLY_PLACE
    text = str(exc)
    return "readonly database" in text or "unable to open database file" in text


def _describe(path: Path, exc: sqlite3.Error, waited_s: float = BUSY_TIMEOUT_S) -> str:
    """One line naming the file, for the CLI's ``tunelab: error:``."""
    text = " ".join(str(exc).split())
    if "locked" in text or "busy" in text:
        return f"profile store {path} is locked by another process (waited {waited_s:g} s): {text}"
    if "not a database" in text or "malformed" in text:
        return f"{path} is not a tunelab profile store (corrupt: {text})"
    return f"profile store {path}: {text}"
