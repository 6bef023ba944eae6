"""A queue's per-host limit set at run time (issue 42): ``task_queues.host_limit``, stored by
``taskrunner queue limit NAME N`` and read by every host's runners and overseers without a
restart; NULL: the config's ``[queues.NAME] limit``.

``task_runner_queues.config_limit``: the ``[queues.NAME] limit`` of the config a runner
registered under, so the claim can tell, in the database, whether the runner's slot is within
the limit in force (the stored one, else its config's). NULL for rows written before.
"""


def up(migrator, db):
    db.execute_sql("ALTER TABLE task_queues ADD COLUMN host_limit INTEGER NULL")
    db.execute_sql("ALTER TABLE task_runner_queues ADD COLUMN config_limit INTEGER NULL")
