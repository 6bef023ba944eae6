"""SQLite, PostgreSQL: ``task_queue_workflow_id`` holds only the tasks added in a workflow
(a partial index ``WHERE workflow_id IS NOT NULL``), as 0014 and 0016 did for the other
mostly-NULL columns.

Why: migration 0020 indexed every task's ``workflow_id``, NULL for every task not added in
a workflow, so each ``add_task`` wrote one more index entry — the newest NULL, on its own
page of the WAL: 12.0 pages per add on SQLite instead of 10.9 (and on PostgreSQL one more
entry per task version an update cannot make in place). The reads of a workflow's tasks
compare the column with a value (``=``, ``IN``), which tells SQLite and PostgreSQL that it
is not NULL, so they keep reading the index. MySQL / MariaDB keep the full index: they have
no partial indexes.
"""
from peewee import PostgresqlDatabase, SqliteDatabase

INDEX = "INDEX task_queue_workflow_id ON task_queue (workflow_id)"


def up(migrator, db):
    if not isinstance(db, (SqliteDatabase, PostgresqlDatabase)):
        return
    db.execute_sql("DROP INDEX IF EXISTS task_queue_workflow_id")
    db.execute_sql("CREATE %s WHERE workflow_id IS NOT NULL" % INDEX)
