"""RunDatabase: runs, their versions, sampled peers and registered clients, in SQLite (WAL).

It lives in the coordinator's ``rounds.sqlite3`` beside the rounds tables (its own
connection), so one file holds every decision a federation made: which contributions a
round accepted (rounds), which global model and optimizer state each version is and who
was sampled for each round and the deadline an ``auto`` run chose for it, with why (here).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from tensorswap.cid import Cid
from tensorswap.rounds.journal import Journal
from tensorswap.runs.errors import InvalidRunSpec, NonFiniteStep, RunsError
from tensorswap.runs.model import ClientInfo, Param, RunInfo, RunSpec, VersionRecord

__all__ = ["RunDatabase"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name        TEXT    PRIMARY KEY,
    spec        TEXT    NOT NULL,
    version     INTEGER NOT NULL,
    global_cid  TEXT    NOT NULL,
    state_cid   TEXT,
    round       INTEGER NOT NULL,
    finished    INTEGER NOT NULL,
    created_at  REAL    NOT NULL
);
CREATE TABLE IF NOT EXISTS run_versions (
    run          TEXT    NOT NULL,
    version      INTEGER NOT NULL,
    global_cid   TEXT    NOT NULL,
    state_cid    TEXT,
    round        INTEGER NOT NULL,
    participants TEXT    NOT NULL,
    staleness    TEXT    NOT NULL,
    at           REAL    NOT NULL,
    PRIMARY KEY (run, version),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS run_selections (
    run    TEXT    NOT NULL,
    round  INTEGER NOT NULL,
    peers  TEXT    NOT NULL,
    PRIMARY KEY (run, round),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS run_trained_on (
    run        TEXT    NOT NULL,
    round      INTEGER NOT NULL,
    peer       TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    PRIMARY KEY (run, round, peer),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS run_deadlines (
    run        TEXT    NOT NULL,
    round      INTEGER NOT NULL,
    deadline_s REAL    NOT NULL,
    reason     TEXT    NOT NULL,
    PRIMARY KEY (run, round),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS run_refusals (
    run      TEXT    NOT NULL,
    round    INTEGER NOT NULL,
    version  INTEGER NOT NULL,
    current  INTEGER NOT NULL,
    stage    TEXT    NOT NULL,
    tensor   TEXT    NOT NULL,
    count    INTEGER NOT NULL,
    peers    TEXT    NOT NULL,
    at       REAL    NOT NULL,
    PRIMARY KEY (run, round),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS clients (
    name          TEXT PRIMARY KEY,
    facts         TEXT NOT NULL,
    registered_at REAL NOT NULL
);
"""


def _text(cid: Cid | None) -> str | None:
    return None if cid is None else str(cid)


def _cid(text: object) -> Cid | None:
    return None if text is None else Cid.parse(str(text))


class RunDatabase:
    """The runs journal; every write commits before it returns (see ``RoundDatabase``)."""

    def __init__(self, path: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.path = Path(path)
        self.journal = Journal(self.path, durable=durable, error=RunsError, what="runs journal")
        """The database file's public journal: the privacy ledger and secure runs register
        their tables on it too."""
        try:
            self.journal.register("runs", _SCHEMA)
        except BaseException:
            self.journal.close()
            raise

    # ── runs ─────────────────────────────────────────────────────────────────
    def insert_run(self, info: RunInfo) -> None:
        with self.journal.transaction() as db:
            db.execute(
                "INSERT INTO runs (name, spec, version, global_cid, state_cid, round, finished,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    info.name,
                    info.spec.to_json(),
                    info.version,
                    str(info.global_cid),
                    _text(info.state_cid),
                    info.round,
                    int(info.finished),
                    info.created_at,
                ),
            )
            db.execute(
                "INSERT INTO run_versions VALUES (?, ?, ?, ?, ?, '[]', '[]', ?)",
                (info.name, 0, str(info.global_cid), _text(info.state_cid), 0, info.created_at),
            )

    def start_round(self, run: str, round: int, peers: tuple[str, ...]) -> None:
        """Record that ``round`` of ``run`` started with ``peers`` sampled."""
        with self.journal.transaction() as db:
            db.execute("UPDATE runs SET round = ? WHERE name = ?", (round, run))
            db.execute(
                "INSERT OR REPLACE INTO run_selections VALUES (?, ?, ?)",
                (run, round, json.dumps(list(peers))),
            )

    def add_version(self, run: str, record: VersionRecord, finished: bool) -> None:
        """Record a new global version and make it the run's current one, in one step."""
        with self.journal.transaction() as db:
            db.execute(
                "INSERT INTO run_versions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run,
                    record.version,
                    str(record.global_cid),
                    _text(record.state_cid),
                    record.round,
                    json.dumps(list(record.participants)),
                    json.dumps(list(record.staleness)),
                    record.at,
                ),
            )
            db.execute(
                "UPDATE runs SET version = ?, global_cid = ?, state_cid = ?, finished = ?"
                " WHERE name = ?",
                (
                    record.version,
                    str(record.global_cid),
                    _text(record.state_cid),
                    int(finished),
                    run,
                ),
            )

    def load_runs(self) -> list[RunInfo]:
        """Every run as journaled; one whose spec no longer validates (journaled before a
        bound it breaks existed, e.g. ``per_round`` of 2^62) is left out, with a warning, so
        the coordinator still starts; its rows stay."""
        rows = self.journal.query(
            "SELECT name, spec, version, global_cid, state_cid, round, finished, created_at"
            " FROM runs ORDER BY created_at, name"
        )
        selections = {
            (run, rnd): tuple(json.loads(str(peers)))
            for run, rnd, peers in self.journal.query(
                "SELECT run, round, peers FROM run_selections"
            )
        }
        deadlines = {
            (run, rnd): (float(d), str(why))
            for run, rnd, d, why in self.journal.query(
                "SELECT run, round, deadline_s, reason FROM run_deadlines"
            )
        }
        out = []
        for name, spec, version, global_cid, state_cid, rnd, finished, created in rows:
            deadline, reason = deadlines.get((name, rnd), (None, ""))
            try:
                loaded = RunSpec.from_json(str(spec))
            except InvalidRunSpec as exc:  # journaled before a bound existed: not resumed
                log.warning(
                    "run %s is not resumed: its journaled spec is refused now: %s", name, exc
                )
                continue
            out.append(
                RunInfo(
                    str(name),
                    loaded,
                    int(version),
                    Cid.parse(str(global_cid)),
                    _cid(state_cid),
                    int(rnd),
                    selections.get((name, rnd), ()),
                    bool(finished),
                    float(created),
                    deadline,
                    reason,
                )
            )
        return out

    def versions(self, run: str) -> list[VersionRecord]:
        rows = self.journal.query(
            "SELECT version, global_cid, state_cid, round, participants, staleness, at"
            " FROM run_versions WHERE run = ? ORDER BY version",
            (run,),
        )
        return [
            VersionRecord(
                int(v),
                Cid.parse(str(g)),
                _cid(s),
                int(r),
                tuple(json.loads(str(p))),
                tuple(json.loads(str(st))),
                float(at),
            )
            for v, g, s, r, p, st, at in rows
        ]

    def selection(self, run: str, round: int) -> tuple[str, ...] | None:
        rows = self.journal.query(
            "SELECT peers FROM run_selections WHERE run = ? AND round = ?", (run, round)
        )
        return tuple(json.loads(str(rows[0][0]))) if rows else None

    def set_deadline(self, run: str, round: int, deadline_s: float, reason: str) -> None:
        """Record the deadline chosen for ``round`` of ``run`` (before the round starts)."""
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO run_deadlines VALUES (?, ?, ?, ?)",
                (run, round, deadline_s, reason),
            )

    def deadline(self, run: str, round: int) -> tuple[float, str] | None:
        """The deadline recorded for ``round`` of ``run`` and its reason, or None."""
        rows = self.journal.query(
            "SELECT deadline_s, reason FROM run_deadlines WHERE run = ? AND round = ?",
            (run, round),
        )
        return (float(rows[0][0]), str(rows[0][1])) if rows else None

    def note_trained_on(self, run: str, round: int, peer: str, version: int) -> None:
        """Record the version an asynchronous contribution trained on (before it is
        submitted; a refused submit leaves a row nothing reads)."""
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO run_trained_on VALUES (?, ?, ?, ?)",
                (run, round, peer, version),
            )

    def trained_on(self, run: str, round: int) -> dict[str, int]:
        rows = self.journal.query(
            "SELECT peer, version FROM run_trained_on WHERE run = ? AND round = ?", (run, round)
        )
        return {str(p): int(v) for p, v in rows}

    def add_refusal(self, refused: NonFiniteStep, at: float) -> None:
        """Record that round ``refused.round`` of ``refused.run`` was refused its version
        (a step that would publish NaN or Inf), with the facts of the refusal."""
        r = refused
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO run_refusals VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (r.run, r.round, r.version, r.current, r.stage, r.tensor, r.count, r.peers, at),
            )

    def refusals(self, run: str, round: int | None = None) -> list[NonFiniteStep]:
        """The refused steps of ``run`` (of round ``round`` only, if given), oldest first,
        as the errors that refused them."""
        where, args = ("run = ? AND round = ?", (run, round)) if round else ("run = ?", (run,))
        rows = self.journal.query(
            "SELECT run, round, version, current, stage, tensor, count, peers FROM run_refusals"
            f" WHERE {where} ORDER BY round",
            args,
        )
        return [
            NonFiniteStep(str(a), int(b), int(c), int(d), str(e), str(f), int(g), str(h))
            for a, b, c, d, e, f, g, h in rows
        ]

    # ── clients ──────────────────────────────────────────────────────────────
    def register(self, name: str, facts: Mapping[str, Param], at: float) -> None:
        self.register_many([(name, facts, at)])

    def register_many(self, rows: Sequence[tuple[str, Mapping[str, Param], float]]) -> None:
        """Record ``(name, facts, registered_at)`` rows in one transaction (one fsync); a
        name already registered keeps its time and takes the new facts."""
        with self.journal.transaction() as db:
            db.executemany(
                "INSERT INTO clients VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE SET"
                " facts = excluded.facts",
                [(name, json.dumps(dict(facts), sort_keys=True), at) for name, facts, at in rows],
            )

    def load_clients(self, now: float) -> list[ClientInfo]:
        """Registered clients; each counts as seen ``now`` (a restart gives every client
        one inactivity period to show up again)."""
        rows = self.journal.query("SELECT name, facts, registered_at FROM clients ORDER BY name")
        return [ClientInfo(str(n), json.loads(str(f)), float(r), now) for n, f, r in rows]

    def close(self) -> None:
        self.journal.close()
