"""PostgreSQL: room on each page of task_runs and task_queue for the updates of a job
(``fillfactor = 50``), and no entry of a successful task in ``task_queue_finished_on``.

Why, counted (bench/wal.py; pg_walinspect's records by relation): a job updates its run twice
(claim, end) and its task once (end), and none of these updates can be HOT — each changes a
column an index or an index's predicate names (``status``, ``finished_on``). With full pages
most new row versions went to another page, and before PostgreSQL leaves a page for another it
logs a lock of the old row (a Heap/LOCK record, 54 bytes) and then an UPDATE that names two
pages and cannot share the old row's bytes: 2.5 run and 1.8 task lock records per job at batch
100 where the rules need two (the claim's run and its task), and the updates' records a quarter
larger. Half of each page free for the rows added to it keeps their versions on their page:
one lock record each, smaller updates, fewer pages touched. ALTER TABLE ... SET (fillfactor) is
a catalog change (no rewrite): pages filled from now on keep the room.

``task_queue_finished_on``: its only reader is rotation, by range of end time; each successful
task's end added an entry (64 bytes of WAL per job). It now holds the failed and cancelled
tasks (kept longer, deleted by their own pass, which still reads it); rotation's pass over
successful tasks takes the oldest in id order (``ORDER BY id LIMIT batch``: the primary key,
read until a batch is found), as SQLite's does since 0015. MySQL
and SQLite are unchanged (no fillfactor; SQLite has no such index since 0015).
"""
from peewee import PostgresqlDatabase

FILLFACTOR = 50
TABLES = ("task_runs", "task_queue")


def up(migrator, db):
    if not isinstance(db, PostgresqlDatabase):
        return
    for table in TABLES:
        db.execute_sql("ALTER TABLE %s SET (fillfactor = %d)" % (table, FILLFACTOR))
    db.execute_sql("DROP INDEX IF EXISTS task_queue_finished_on")
    db.execute_sql("CREATE INDEX task_queue_finished_on ON task_queue (finished_on) "
                   "WHERE finished_on IS NOT NULL AND last_status <> 'success'")
