"""`taskrunner runner --reload`, for development: a change to a task module it imported
stops the runner as HUP does (its run finished) and starts it again in the same process,
so the next task runs the code on disk."""
import os
import signal
import subprocess
import sys

import pytest

from conftest import process_env, usage_error, taskrunner, wait_for
from taskrunner.store.models import SUCCESS

MODULE = '''from taskrunner import TaskHandler


class Version(TaskHandler):
    def handle(self, run):
        run.results = {"version": %d, "pid": __import__("os").getpid()}
'''


def write_module(path, version):
    path.write_text(MODULE % version)
    # A later mtime than the one the runner saw, however coarse the file system's clock.
    later = os.stat(path).st_mtime + 2 * version
    os.utime(path, (later, later))


@pytest.mark.timeout(180)
def test_a_changed_task_module_restarts_the_runner_with_the_new_code(sqlite_db, tmp_path,
                                                                    monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    write_module(code / "reload_tasks.py", 1)
    monkeypatch.syspath_prepend(str(code))      # add_task checks the handler imports
    queue = sqlite_db.queue()
    config = sqlite_db.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.1\n")
    env = process_env()
    env["PYTHONPATH"] = str(code) + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen([sys.executable, "-m", "taskrunner", "--config", config, "runner",
                             "--reload"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        first = queue.add_task("reload_tasks.Version")
        wait_for(lambda: proc.poll() is not None or queue.get_task(first).status == SUCCESS,
                 timeout=60, message="the first task to succeed")
        assert queue.get_task(first).results["version"] == 1
        write_module(code / "reload_tasks.py", 2)
        second = queue.add_task("reload_tasks.Version")
        wait_for(lambda: proc.poll() is not None or queue.get_task(second).status == SUCCESS,
                 timeout=60, message="the second task to succeed")
        results = queue.get_task(second).results
        assert results == {"version": 2, "pid": proc.pid}, results
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "reload_tasks.py changed; restarting (--reload)" in err, err
    queue.close()


def test_reload_and_burst_exclude_each_other(sqlite_db):
    usage_error(taskrunner("runner", "--reload", "--burst", url=sqlite_db.url), "--reload")
