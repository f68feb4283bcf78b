"""The public journal: owners register schemas and migrations, write in transactions, read
with queries; nothing outside rounds/journal/ touches sqlite3, a connection or its lock."""

from __future__ import annotations

import ast
import sqlite3
from pathlib import Path

import pytest

from tensorswap.errors import RoundsError, RunsError
from tensorswap.rounds.journal import DB_FILENAME, Journal, RoundDatabase, Tx
from tensorswap.runs.journal import RunDatabase

SRC = Path(__file__).resolve().parents[1] / "src" / "tensorswap"

_V1 = "CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL);"
_V2 = """
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY, text TEXT NOT NULL, stars INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tags (note INTEGER NOT NULL, tag TEXT NOT NULL);
"""


def _add_stars(tx: Tx) -> None:
    if "stars" not in tx.columns("notes"):
        tx.execute("ALTER TABLE notes ADD COLUMN stars INTEGER NOT NULL DEFAULT 0")


def test_an_owner_registers_writes_and_reads(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.sqlite3") as journal:
        assert journal.register("notes", _V1) == 0
        with journal.transaction() as tx:
            assert tx.execute("INSERT INTO notes (text) VALUES (?)", ("a",)) == 1
            assert tx.executemany("INSERT INTO notes (text) VALUES (?)", [("b",), ("c",)]) == 2
        assert journal.query("SELECT text FROM notes ORDER BY id") == [("a",), ("b",), ("c",)]
        assert journal.query_one("SELECT text FROM notes WHERE id = 9") is None
        assert journal.versions() == {"notes": 0}


def test_a_body_that_raises_rolls_back(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.sqlite3") as journal:
        journal.register("notes", _V1)
        with pytest.raises(KeyError), journal.transaction() as tx:
            tx.execute("INSERT INTO notes (text) VALUES ('kept?')")
            raise KeyError("no")
        assert journal.query("SELECT COUNT(*) FROM notes") == [(0,)]


def test_sqlite_errors_come_as_the_owners_error_type(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.sqlite3", error=RunsError, what="runs journal") as journal:
        with pytest.raises(RunsError, match=r"runs journal .*no such table"):
            journal.query("SELECT * FROM nowhere")
        with pytest.raises(RunsError, match="no such table"), journal.transaction() as tx:
            tx.execute("INSERT INTO nowhere VALUES (1)")


def test_migrations_run_once_in_order_from_the_recorded_version(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    with Journal(path) as journal:
        journal.register("notes", _V1)
        with journal.transaction() as tx:
            tx.execute("INSERT INTO notes (text) VALUES ('old')")
    with Journal(path) as journal:  # a newer tensorswap: version 1 adds stars and tags
        assert journal.register("notes", _V2, [_add_stars]) == 1
        assert journal.query("SELECT text, stars FROM notes") == [("old", 0)]
        assert journal.query("SELECT COUNT(*) FROM tags") == [(0,)]
    with Journal(path) as journal:  # registering again changes nothing
        assert journal.register("notes", _V2, [_add_stars]) == 1
        assert journal.versions() == {"notes": 1}


def test_a_fresh_file_gets_the_current_schema_without_migrating(tmp_path: Path) -> None:
    def refuse(tx: Tx) -> None:
        raise AssertionError("a fresh owner does not migrate")

    with Journal(tmp_path / "j.sqlite3") as journal:
        assert journal.register("notes", _V2, [refuse]) == 1
        assert (
            "stars"
            in journal.query_one("SELECT group_concat(name) FROM pragma_table_info('notes')")[0]
        )  # type: ignore[index]


def test_tables_from_before_the_registry_migrate_from_version_zero(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(_V1 + "INSERT INTO notes (text) VALUES ('legacy');")
    conn.close()
    with Journal(path) as journal:
        assert journal.register("notes", _V2, [_add_stars]) == 1
        assert journal.query("SELECT text, stars FROM notes") == [("legacy", 0)]


def test_a_newer_schema_than_this_code_knows_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    with Journal(path) as journal:
        journal.register("notes", _V2, [_add_stars])
    with Journal(path) as journal, pytest.raises(RoundsError, match=r"version 1.*knows up to 0"):
        journal.register("notes", _V1)


def test_the_rounds_runs_and_privacy_owners_share_one_file(tmp_path: Path) -> None:
    from tensorswap.runs.dp_ledger import PrivacyLedger

    with RoundDatabase.in_dir(tmp_path) as rounds:
        runs = RunDatabase(tmp_path / DB_FILENAME)
        try:
            PrivacyLedger(runs)
            assert rounds.journal.versions() == {"rounds": 1, "runs": 0, "privacy": 0}
        finally:
            runs.close()


def test_a_journal_from_before_contributions_had_a_scale_is_migrated(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / DB_FILENAME)
    conn.executescript(
        "CREATE TABLE rounds (round INTEGER, initiator TEXT);"
        "CREATE TABLE contributions (round INTEGER, initiator TEXT, peer TEXT, seq INTEGER,"
        " update_cid TEXT, num_samples INTEGER, nbytes INTEGER, submitted_at REAL);"
    )
    conn.close()
    with RoundDatabase.in_dir(tmp_path) as db:
        with db.journal.transaction() as tx:
            assert "scale" in tx.columns("contributions")
        assert db.journal.versions()["rounds"] == 1


# ── the boundary ─────────────────────────────────────────────────────────────
_JOURNAL = SRC / "rounds" / "journal"
_PRIVATE = {"_conn", "_lock", "_transaction", "_query"}


def _journal_like(node: ast.expr) -> bool:
    label = ast.unparse(node).lower()
    return any(word in label for word in ("journal", "db", "ledger", "database"))


def _offences(text: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text, name)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if "sqlite3" in names or module == "sqlite3":
                found.append(f"{name}:{node.lineno} imports sqlite3")
        if isinstance(node, ast.Attribute) and node.attr in _PRIVATE:
            inner = node.value
            if isinstance(inner, ast.Name) and inner.id in {"self", "cls"}:
                continue
            if node.attr == "_lock" and not _journal_like(inner):
                continue  # a client's connection lock, say: not a database's
            found.append(f"{name}:{node.lineno} reads .{node.attr} of another object")
    return found


def test_nothing_outside_the_journal_touches_sqlite_or_a_connection() -> None:
    offences = [
        o
        for path in sorted(SRC.rglob("*.py"))
        if _JOURNAL not in path.parents
        for o in _offences(path.read_text(), str(path.relative_to(SRC)))
    ]
    assert offences == []


def test_the_boundary_check_sees_an_import_and_a_borrowed_connection() -> None:
    text = (
        "import sqlite3\n\ndef f(runs, client):\n"
        "    return runs.journal._conn, runs.journal._lock, client._lock, self._lock\n"
    )
    assert _offences(text, "probe.py") == [
        "probe.py:1 imports sqlite3",
        "probe.py:4 reads ._conn of another object",
        "probe.py:4 reads ._lock of another object",
    ]
