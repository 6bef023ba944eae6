from taskrunner.store.models import SUCCESS


def test_a_task_is_done_in_process(queue):
    task_id = queue.add_task("taskrunner.handlers.Echo", data={"hello": "world"})
    assert queue.run_pending() == 1
    task = queue.get_task(task_id)
    assert task.status == SUCCESS
    runs = queue.runs_of(task_id)
    assert [r.status for r in runs] == [SUCCESS]
    assert runs[0].results == {"hello": "world"}
