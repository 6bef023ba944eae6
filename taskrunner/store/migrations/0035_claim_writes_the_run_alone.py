"""A claim writes the run alone: a task's row keeps ``last_status = 'scheduled'`` while its run
runs, and every reader sees ``running`` on the run (``task_runs.status``, off the partial index
of running runs: reads/records.py `running_runs`). One row version fewer per job: before, the
claim also wrote the task row (``last_status = 'running'``). The rows marked so by a claim
before this migration are marked ``scheduled``, as a claim now leaves them; their runs still say
``running``.
"""


def up(migrator, db):
    db.execute_sql("UPDATE task_queue SET last_status = 'scheduled' WHERE last_status = 'running'")
