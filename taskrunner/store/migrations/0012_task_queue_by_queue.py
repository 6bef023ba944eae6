"""The tasks of one queue, newest first: the dashboard's ``/tasks?queue=NAME`` reads this
index instead of every task (a rare queue in a long history)."""


def up(migrator, db):
    db.execute_sql("CREATE INDEX task_queue_by_queue ON task_queue (queue, id)")
