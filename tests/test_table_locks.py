"""Table directories stay clean: lock files live in one `.locks/` folder (every writer of a table uses the
same one), and tables are written readable by others (the umask's mode, not mkstemp's 0600)."""

from __future__ import annotations

import os
import stat
import threading

import filelock

from moe_tune.profiles.table import lock_path
from moe_tune.profiles.table import write_entries
from moe_tune.tuner.request import SweepLog


def _entry(key: str) -> dict:
    return {"key": key, "fields": {"m": 1}, "config": {"tm": 8}}


def test_table_dir_holds_only_tables_and_tables_are_shared_readable(tmp_path):
    table = tmp_path / "cpu" / "ragged_dot.json"
    old = os.umask(0o022)
    try:
        write_entries(table, "ragged_dot", "cpu", [_entry("a")])
    finally:
        os.umask(old)
    assert sorted(p.name for p in table.parent.iterdir()) == [".locks", "ragged_dot.json"]
    assert stat.S_IMODE(table.stat().st_mode) == 0o644
    assert lock_path(table) == table.parent / ".locks" / "ragged_dot.json.lock"
    assert lock_path(table).exists()
    os.umask(0o077)  # a private umask is respected
    try:
        write_entries(table, "ragged_dot", "cpu", [_entry("b")])
    finally:
        os.umask(old)
    assert stat.S_IMODE(table.stat().st_mode) == 0o600


def test_a_writer_waits_for_the_lock_at_lock_path(tmp_path):
    """The lock `lock_path` names is the one writers take: while it is held, a write does not happen."""
    table = tmp_path / "cpu" / "ragged_dot.json"
    write_entries(table, "ragged_dot", "cpu", [_entry("a")])
    held = filelock.FileLock(str(lock_path(table)))
    held.acquire()
    writer = threading.Thread(target=write_entries, args=(table, "ragged_dot", "cpu", [_entry("b")]))
    writer.start()
    writer.join(timeout=1.0)
    assert writer.is_alive() and '"b"' not in table.read_text()
    held.release()
    writer.join()
    assert '"b"' in table.read_text()


def test_sweep_log_lock_is_in_the_locks_folder(tmp_path):
    log = tmp_path / "cpu" / "sweeps" / "ragged_dot" / "x.jsonl"
    with SweepLog(log, {"identity": {}, "versions": {}}):
        assert lock_path(log).exists()
    assert sorted(p.name for p in log.parent.iterdir()) == [".locks", "x.jsonl"]
