"""A task waiting for its parents is ``waiting`` (``task_queue.last_status``), as a durable
sleeper is and as its workflow counts it: every view reads that one column (``show``,
``tasks --status``, the dashboard, ``/metrics``). Before this migration such a task was stored
``scheduled``; the tasks waiting now are marked (new ones are written ``waiting`` when
added, and ``scheduled`` in the statement that releases them: runs/graph.py).
"""


def up(migrator, db):
    db.execute_sql("UPDATE task_queue SET last_status = 'waiting' WHERE waiting_parents > 0 "
                   "AND finished_on IS NULL AND last_status = 'scheduled'")
