"""Workflows: tasks that wait for other tasks (DESIGN, "Graph").

``task_dependencies`` holds one row per edge: the task ``task_id`` runs after its parent
``parent_id``; ``satisfied`` once the parent succeeded (or failed, for a dependent that runs
anyway), so an edge is counted once whatever happens to the parent later (a retry).
On ``task_queue``: ``waiting_parents``, the edges of a task not satisfied yet while it waits
(NULL for a task that never waited or was released: it then has, or had, its runs);
``dependents``, the edges from the task as a parent (0 for most tasks: their success then
releases nothing, and costs nothing more); ``on_parent_failure`` (NULL: cancel) and
``workflow_id``, the ``task_workflows`` row of the tasks added together.
"""
from peewee import (BooleanField, CharField, DateTimeField, IntegerField, Model)


def up(migrator, db):
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN workflow_id INTEGER NULL")
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN dependents INTEGER NOT NULL DEFAULT 0")
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN waiting_parents INTEGER NULL")
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN on_parent_failure VARCHAR(8) NULL")
    db.execute_sql("CREATE INDEX task_queue_workflow_id ON task_queue (workflow_id)")

    class Dependency(Model):
        task_id = IntegerField()
        parent_id = IntegerField()
        satisfied = BooleanField(default=False)

        class Meta:
            database = db
            table_name = "task_dependencies"
            indexes = ((("parent_id", "task_id"), True), (("task_id", "parent_id"), False))

    class Workflow(Model):
        name = CharField(null=True)
        created_on = DateTimeField()
        task_count = IntegerField(default=0)

        class Meta:
            database = db
            table_name = "task_workflows"

    db.create_tables([Dependency, Workflow])
