"""What a PostgreSQL queue writes per job, counted in its WAL (pg_walinspect's records of this
database's tables and indexes, a replication slot holding the WAL from the first LSN): the
lock records a job needs and no more, and no index entry that no query of a plain job's row
reads (migration 0036). Counted, not timed: the same jobs write the same records."""
import collections
import re
import uuid

import pytest

from conftest import Database
from taskrunner.runner.loop import Runner
from taskrunner.store.bound import Store

ECHO = "taskrunner.handlers.Echo"
JOBS = 400


def _records(sql, start, end):
    """{(record type, relation name): count} of this database's WAL records in [start, end)."""
    oid = sql("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()[0]
    names = dict(sql("SELECT pg_relation_filenode(oid)::text, relname::text FROM pg_class "
                     "WHERE relnamespace = 'public'::regnamespace "
                     "AND pg_relation_filenode(oid) IS NOT NULL").fetchall())
    ours = re.compile(r"rel \d+/%d/(\d+)" % oid)
    counts = collections.Counter()
    for kind, blocks in sql("SELECT resource_manager || '/' || record_type, block_ref FROM "
                            "pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)", (start, end)):
        found = ours.findall(blocks or "")
        if found:
            counts[kind, names.get(found[0], found[0])] += 1
    return counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch", [1, 100])
def test_a_job_writes_no_end_time_of_a_success_and_one_run_key_per_version(tmp_path, batch):
    """Each successful task's end added an entry to task_queue_finished_on before 0036 (400
    for 400 jobs); now none. (Before 0036 most new row versions of a full page also went to
    another page, with a lock record of the old row before it left: 2.0 run and 2.9-3.0 task
    lock records per job here, 1.4-1.5 and 2.0 after; counted in the message, not asserted,
    see below.)"""
    database = Database("postgresql", tmp_path)
    slot = "trtest_%s" % uuid.uuid4().hex[:12]
    queue = database.queue()
    sql = queue.store.db.execute_sql
    try:
        sql("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        queue.add_tasks([{"handler": ECHO} for _ in range(JOBS)])
        sql("ANALYZE")
        # The slot keeps the server from recycling the WAL the count reads.
        # Temporary: dropped with this session if the test is killed before its finally.
        sql("SELECT pg_create_physical_replication_slot(%s, true, true)", (slot,))
        start = sql("SELECT pg_current_wal_lsn()").fetchone()[0]
        store = Store(database.config(runner={"batch": batch}))
        assert Runner(store, install_signals=False, memory_limit=False).work(burst=True) == JOBS
        store.close()
        end = sql("SELECT pg_current_wal_lsn()").fetchone()[0]
        counts = _records(sql, start, end)
        per_job = {key: round(n / JOBS, 2) for key, n in counts.items()}
        assert counts["Btree/INSERT_LEAF", "task_queue_finished_on"] == 0, per_job
        assert counts["Btree/INSERT_LEAF", "task_runs_pkey"] <= 2 * JOBS, per_job   # claim, end
        # The lock records per job are not asserted: on the shared server another test's
        # snapshot holds back pruning, pages fill with dead versions and new ones move off
        # them again (1.4-1.5 run locks per job here alone, 1.0 in bench/wal.py's drain on
        # a cluster of its own, about 2.0 before 0036): bench/wal.py counts them.
    finally:
        sql("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s", (slot,))
        queue.close()
        database.drop()


@pytest.mark.timeout(120)
def test_an_existing_database_gets_the_room_and_the_narrower_index(tmp_path):
    """Migration 0036 on a database at 0035 with a successful and a failed task: the tables
    keep room on their pages from then on, and the index of end times holds the failed task
    alone, which rotation's pass over failed tasks still reads."""
    from playhouse.migrations import Runner as MigrationRunner
    from taskrunner.store.migrations import DIRECTORY, HISTORY_TABLE
    database = Database("postgresql", tmp_path, empty=True)
    try:
        store = database.store_at("0035_claim_writes_the_run_alone")
        sql = store.db.execute_sql
        for status in ("success", "error"):
            sql("INSERT INTO task_queue (queued_on, scheduled_on, handler, data, priority, "
                "last_status, max_retries, runs_failed, run_count, run_timeout, updated_on, "
                "finished_on, crash_count, runs_crashed, queue, dependents) VALUES (now(), "
                "now(), %s, '{}', 0, %s, 0, 0, 1, 60, now(), now(), 0, 0, 'default', 0)",
                (ECHO, status))
        MigrationRunner(store.db, DIRECTORY, table_name=HISTORY_TABLE).up()
        options = dict(sql("SELECT relname::text, reloptions FROM pg_class WHERE relname IN "
                           "('task_runs', 'task_queue')").fetchall())
        assert options == {"task_runs": ["fillfactor=50"], "task_queue": ["fillfactor=50"]}
        with store.db.atomic():
            sql("SET LOCAL enable_seqscan = off")
            statement = ("SELECT last_status FROM task_queue WHERE finished_on < now() + "
                         "interval '1 day' AND last_status IN ('error', 'timeout', 'cancelled')")
            plan = " | ".join(row[0] for row in sql("EXPLAIN " + statement))
            assert "task_queue_finished_on" in plan, plan
            assert [row[0] for row in sql(statement)] == ["error"]
        store.close()
    finally:
        database.drop()
