"""Handlers the wake-up tests run inside real runners."""
from taskrunner import TaskHandler


class HeldNotifications(TaskHandler):
    """Adds data["adds"] tasks to the paused queue "parked" through a queue of its own (as
    another process would), then reports what the runner's own connection holds: the
    channels its session LISTENs on and the notifications waiting on it."""

    def handle(self, run):
        from taskrunner import TaskQueue
        other = TaskQueue(run.queue.store.config)
        try:
            for _ in range(run.data["adds"]):
                other.add_task("taskrunner.handlers.Echo", queue="parked")
        finally:
            other.close()
        db = run.queue.store.db
        channels = [row[0] for row in db.execute_sql("SELECT pg_listening_channels()")]
        db.execute_sql("SELECT pg_sleep(0.2)")    # notifications sent meanwhile arrive here
        held = sum(1 for _ in db.connection().notifies(timeout=0))
        run.results = {"channels": channels, "held": held}
