"""In-Portal's command line, to the letter: ``run_event.php task-runner:OnProcess
password_here``. `taskrunner run-event UNIT:EVENT PASSWORD` takes the trailing password: with
``[run_event] password_hash`` set, every event requires it (PBKDF2, compared in constant
time); without one, a password given is refused with one line saying how to set one. The
password is never echoed, whatever is wrong; a refused event does nothing. Since a command
line is in `ps` for every local user, the password may come from an owner-only file
(`--password-file`) or the environment instead.

The runner and the CLI check it without the web package (the hashing lives in
taskrunner.passwords, layer 1)."""
import os
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from conftest import REPO_DIR, ok, process_env, runs_of, taskrunner, usage_error, \
    wait_for
from taskrunner.config import Config
from taskrunner.errors import ConfigError
from taskrunner.store.models import SCHEDULED, SUCCESS, Task

PASSWORD = "password_here"
ECHO = "taskrunner.handlers.Echo"


def hash_of(password):
    """What `taskrunner run-event --hash-password` prints for `password` on stdin."""
    result = subprocess.run([sys.executable, "-m", "taskrunner", "run-event", "--hash-password"],
                            input=password + "\n", capture_output=True, text=True, timeout=60,
                            env=process_env())
    assert result.returncode == 0, result.stderr
    assert password not in result.stdout + result.stderr
    return result.stdout.strip()


@pytest.fixture(scope="module")
def stored_hash():
    return hash_of(PASSWORD)


def config_with(db, tmp_path, password_hash=None):
    text = "[runner]\npoll_interval = 0.1\n"
    if password_hash is not None:
        text += '[run_event]\npassword_hash = "%s"\n' % password_hash
    return db.write_config(tmp_path / "c.toml", text)


def due_task(queue):
    """A task whose run task-queue:OnProcess would create (its scheduled time has come, no
    run yet): what a refused event must leave alone."""
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    task_id = queue.add_task(ECHO, data={"n": 1}, scheduled_on=later)
    past = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(seconds=1)
    Task.update(scheduled_on=past, next_run_on=past).where(Task.id == task_id).execute()
    assert runs_of(task_id) == []
    return task_id


def test_hash_password_prints_a_pbkdf2_hash_that_the_config_takes(stored_hash, tmp_path):
    assert stored_hash.startswith("pbkdf2_sha256$"), stored_hash
    config = Config.from_dict({"run_event": {"password_hash": stored_hash}})
    assert config.run_event.password_hash == stored_hash
    empty = subprocess.run([sys.executable, "-m", "taskrunner", "run-event", "--hash-password"],
                           input="", capture_output=True, text=True, timeout=60,
                           env=process_env())
    usage_error(empty, "standard input")


@pytest.mark.parametrize("value", ['"s3cret"', '"pbkdf2_sha256$x"', "5"])
def test_a_password_hash_that_is_not_one_names_the_file_and_the_key(tmp_path, value):
    path = tmp_path / "c.toml"
    path.write_text("[run_event]\npassword_hash = %s\n" % value)
    with pytest.raises(ConfigError) as err:
        Config.load(str(path), environ={})
    message = str(err.value)
    assert str(path) in message and "[run_event] password_hash" in message, message
    assert "s3cret" not in message


@pytest.mark.timeout(120)
def test_the_seeds_line_runs_a_runner_with_the_right_password(sqlite_db, tmp_path, stored_hash):
    """`run-event task-runner:OnProcess password_here`, as In-Portal's crontab and
    supervisord lines have it, in a process of its own: the runner starts and works."""
    queue = sqlite_db.queue()
    task_id = queue.add_task(ECHO, data={"n": 1})
    config = config_with(sqlite_db, tmp_path, stored_hash)
    proc = subprocess.Popen([sys.executable, "-m", "taskrunner", "--config", config, "run-event",
                             "task-runner:OnProcess", PASSWORD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=process_env(),
                            start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or queue.get_task(task_id).status == SUCCESS,
                 timeout=60, message="task %d to succeed" % task_id)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert queue.get_task(task_id).status == SUCCESS, err
    assert PASSWORD not in out + err
    queue.close()


def test_other_events_take_the_password_too(sqlite_db, tmp_path, stored_hash):
    queue = sqlite_db.queue()
    config = config_with(sqlite_db, tmp_path, stored_hash)
    for event in ("task-queue:OnProcess", "task-queue:OnRotate", "periodic-task:OnProcess"):
        result = taskrunner("run-event", event, PASSWORD, "--json", config=config)
        assert PASSWORD not in ok(result) + result.stderr, event
    queue.close()


def refused_event(result, *fragments):
    line = usage_error(result, *fragments)
    assert PASSWORD not in result.stdout + result.stderr
    assert "wrong" not in line or "password" in line
    return line


@pytest.mark.parametrize("argv, fragments", [
    (("task-queue:OnProcess",), ("password is required", "[run_event] password_hash")),
    (("task-queue:OnProcess", "password_her"), ("wrong password",)),
    (("task-queue:OnProcess", "Password_here"), ("wrong password",)),
    (("task-queue:OnProcess", ""), ("wrong password",)),
], ids=["missing", "one-short", "case", "empty"])
def test_a_missing_or_wrong_password_is_refused_and_the_event_does_nothing(
        sqlite_db, tmp_path, stored_hash, argv, fragments):
    queue = sqlite_db.queue()
    config = config_with(sqlite_db, tmp_path, stored_hash)
    task_id = due_task(queue)
    refused_event(taskrunner("run-event", *argv, config=config), *fragments)
    assert runs_of(task_id) == []
    ok(taskrunner("run-event", "task-queue:OnProcess", PASSWORD, config=config))
    assert [r.status for r in runs_of(task_id)] == [SCHEDULED]
    queue.close()


def test_a_password_given_when_none_is_set_is_refused_saying_how_to_set_one(sqlite_db,
                                                                            tmp_path):
    queue = sqlite_db.queue()
    config = config_with(sqlite_db, tmp_path)
    for event in ("task-queue:OnProcess", "task-runner:OnProcess"):
        line = refused_event(taskrunner("run-event", event, PASSWORD, config=config),
                             "[run_event] password_hash", "--hash-password")
        assert "no run-event password is set" in line, line
    ok(taskrunner("run-event", "task-queue:OnProcess", config=config))
    queue.close()


@pytest.mark.parametrize("argv", [
    ("task-queue:OnProcess", "-" + PASSWORD),
    ("task-queue:OnProcess", "-h" + PASSWORD),
    ("task-queue:OnProcess", "--json=" + PASSWORD),
    ("task-queue:OnProcess", PASSWORD, "extra"),
    ("task-queue:OnProcess", "extra", PASSWORD),
    ("task-queue:OnProces", PASSWORD),
], ids=["looks-like-an-option", "explicit-argument-of-h", "explicit-argument-of-json",
        "extra-after", "extra-before", "bad-event"])
def test_no_usage_error_echoes_the_password(sqlite_db, tmp_path, stored_hash, argv):
    config = config_with(sqlite_db, tmp_path, stored_hash)
    refused_event(taskrunner("run-event", *argv, config=config))


def test_a_password_starting_with_a_dash_goes_after_double_dash(sqlite_db, tmp_path):
    config = config_with(sqlite_db, tmp_path, hash_of("-" + PASSWORD))
    ok(taskrunner("run-event", "task-queue:OnProcess", "--", "-" + PASSWORD, config=config))


def test_run_event_checks_the_password_without_the_web_package(sqlite_db, tmp_path, stored_hash):
    """The runner and the CLI never import taskrunner.web: the hashing is at layer 1."""
    config = config_with(sqlite_db, tmp_path, stored_hash)
    script = ("import sys; sys.modules['taskrunner.web'] = None\n"
              "from taskrunner.cli import main\n"
              "sys.exit(main(['--config', %r, 'run-event', 'task-queue:OnProcess', %r]))"
              % (config, PASSWORD))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, env=process_env(), cwd=REPO_DIR)
    assert result.returncode == 0, result.stderr
    assert "taskrunner.web" not in result.stderr


@pytest.mark.parametrize("argv", [
    ("run-event", PASSWORD),
    ("run-event", PASSWORD, "task-queue:OnProcess"),
    ("run-event", "task-queue:OnProces", PASSWORD),
    ("run-event", "--queue", PASSWORD),
], ids=["event-left-out", "swapped", "mistyped-event", "as-option-value"])
def test_a_command_line_without_a_valid_event_never_quotes_the_password(sqlite_db, tmp_path,
                                                                         stored_hash, argv):
    config = config_with(sqlite_db, tmp_path, stored_hash)
    result = taskrunner(*argv, config=config)
    assert result.returncode == 2, result
    assert PASSWORD not in result.stdout + result.stderr, result.stderr


def password_file(tmp_path, text=PASSWORD + "\n", mode=0o600):
    path = tmp_path / "run-event.password"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", ["file", "env"])
def test_a_runner_given_the_password_by_file_or_environment_never_shows_it_in_ps(
        sqlite_db, tmp_path, stored_hash, way):
    """The long-lived runner of a supervisord `numprocs` program: its command line, which
    every local user reads in `ps`, holds no password."""
    import psutil
    queue = sqlite_db.queue()
    task_id = queue.add_task(ECHO, data={"n": 1})
    config = config_with(sqlite_db, tmp_path, stored_hash)
    argv = [sys.executable, "-m", "taskrunner", "--config", config, "run-event",
            "task-runner:OnProcess"]
    env = process_env()
    if way == "file":
        argv += ["--password-file", password_file(tmp_path)]
    else:
        env["TASKRUNNER_RUN_EVENT_PASSWORD"] = PASSWORD
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or queue.get_task(task_id).status == SUCCESS,
                 timeout=60, message="task %d to succeed" % task_id)
        assert proc.poll() is None, proc.communicate()
        assert PASSWORD not in " ".join(psutil.Process(proc.pid).cmdline())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert PASSWORD not in out + err
    queue.close()


@pytest.mark.parametrize("way", ["file", "env"])
def test_a_wrong_password_by_file_or_environment_is_refused_without_echoing_it(
        sqlite_db, tmp_path, stored_hash, way):
    queue = sqlite_db.queue()
    config = config_with(sqlite_db, tmp_path, stored_hash)
    task_id = due_task(queue)
    wrong = "Password_here"
    if way == "file":
        result = taskrunner("run-event", "task-queue:OnProcess", "--password-file",
                            password_file(tmp_path, wrong + "\n"), config=config)
    else:
        result = taskrunner("run-event", "task-queue:OnProcess", config=config,
                            env={"TASKRUNNER_RUN_EVENT_PASSWORD": wrong})
    usage_error(result, "wrong password")
    assert wrong not in result.stdout + result.stderr
    assert runs_of(task_id) == []
    right = taskrunner("run-event", "task-queue:OnProcess", config=config,
                       env={"TASKRUNNER_RUN_EVENT_PASSWORD": PASSWORD})
    assert PASSWORD not in ok(right) + right.stderr
    assert [r.status for r in runs_of(task_id)] == [SCHEDULED]
    queue.close()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_password_file_others_may_read_or_write_is_refused(sqlite_db, tmp_path, stored_hash,
                                                             mode):
    config = config_with(sqlite_db, tmp_path, stored_hash)
    path = password_file(tmp_path, mode=mode)
    line = usage_error(taskrunner("run-event", "task-queue:OnProcess", "--password-file", path,
                                  config=config), path, "chmod 600")
    assert PASSWORD not in line


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_password_file_of_another_user_is_refused(sqlite_db, tmp_path, stored_hash):
    config = config_with(sqlite_db, tmp_path, stored_hash)
    path = password_file(tmp_path)
    os.chown(path, 65534, -1)
    line = usage_error(taskrunner("run-event", "task-queue:OnProcess", "--password-file", path,
                                  config=config), path, "owned by uid 65534")
    assert PASSWORD not in line


def test_a_missing_or_empty_password_file_and_two_sources_are_refused(sqlite_db, tmp_path,
                                                                     stored_hash):
    config = config_with(sqlite_db, tmp_path, stored_hash)
    usage_error(taskrunner("run-event", "task-queue:OnProcess", "--password-file",
                           str(tmp_path / "nowhere"), config=config), "No such file")
    usage_error(taskrunner("run-event", "task-queue:OnProcess", "--password-file",
                           password_file(tmp_path, "\n"), config=config), "empty")
    result = taskrunner("run-event", "task-queue:OnProcess", PASSWORD, "--password-file",
                        password_file(tmp_path), config=config)
    usage_error(result, "one way")
    assert PASSWORD not in result.stderr
