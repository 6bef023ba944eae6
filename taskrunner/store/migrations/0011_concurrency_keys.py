"""Concurrency keys: at most ``concurrency_limit`` live runs of the tasks sharing a
``concurrency_key``, across all hosts. A live run of such a task holds a slot 1..limit of
its key (``task_runs.concurrency_slot``, NULL once the run is final) under a unique index
on (concurrency_key, concurrency_slot); a task that finds no free slot waits with
``task_queue.waiting_key`` set until one frees."""

COLUMNS = (
    ("task_queue", "concurrency_key VARCHAR(255) NULL"),
    ("task_queue", "concurrency_limit INTEGER NULL"),
    ("task_queue", "waiting_key VARCHAR(255) NULL"),
    ("task_runs", "concurrency_key VARCHAR(255) NULL"),
    ("task_runs", "concurrency_slot INTEGER NULL"),
)


def up(migrator, db):
    for table, column in COLUMNS:
        db.execute_sql("ALTER TABLE %s ADD COLUMN %s" % (table, column))
    db.execute_sql("CREATE UNIQUE INDEX task_runs_concurrency_slot ON task_runs "
                   "(concurrency_key, concurrency_slot)")
    db.execute_sql("CREATE INDEX task_queue_waiting_key ON task_queue (waiting_key)")
