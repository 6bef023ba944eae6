"""Another local user can neither read, redirect nor delete anything through taskrunner's
runtime files (DESIGN.md rule 11): a wake-up directory planted as a symlink, a wake-up or
claim directory created beforehand by someone else, a claim file waiting for a runner, a
socket bound in the hub's place — each is refused or avoided, in a public directory like
/tmp and in the README's setgid group directory (whose members share on purpose), and the
hub hears only its own user and group. Each test runs the other side as a real second user
(tests/local_users.py)."""
import os
import signal
import stat
import subprocess
import tempfile

import pytest
from conftest import Database, spawn, stop_process, wait_for
from local_users import as_user, other_user, run_as  # noqa: F401 - other_user: a fixture

from taskrunner.host import claimfile, wakeup
from taskrunner.store.models import SUCCESS, Task

ECHO = "taskrunner.handlers.Echo"


@pytest.fixture(params=["public", "group"])
def base(request, other_user):
    """A wake-up base directory the other user may write: a public one like /tmp (1777), or
    the README's setgid group directory (2770) with the other user in its group."""
    path = tempfile.mkdtemp(prefix="trsec-")
    if request.param == "public":
        os.chmod(path, 0o1777)
    else:
        os.chown(path, 0, other_user.pw_gid)
        os.chmod(path, 0o2770)
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


PLANT_LINK = """
os.symlink(sys.argv[2], sys.argv[1])
"""


def test_a_planted_symlink_never_makes_add_delete_files(other_user, base, tmp_path):
    """The other user links the wake-up directory's name to a directory of the victim's;
    the victim's `add` (no hub there: it writes to every socket it finds) must not treat
    that directory's files as dead sockets. (In the public directory only with
    fs.protected_symlinks = 0; in the group directory whatever it says.)"""
    precious = tmp_path / "precious"
    precious.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (precious / name).write_text(name)
    database = Database("sqlite", tmp_path)
    directory = wakeup.directory(database.url, base)
    run_as(other_user, PLANT_LINK, directory, str(precious))
    queue = database.queue(runner={"wakeup_dir": base})
    try:
        queue.add_task(ECHO)
        queue.add_task(ECHO)
    finally:
        queue.close()
    assert sorted(os.listdir(precious)) == ["a.txt", "b.txt", "c.txt"]
    assert os.path.islink(directory), "the other user's link was replaced or followed"


PLANT_CLAIMS = """
claimed = sys.argv[1]
os.mkdir(claimed)
os.chmod(claimed, int(sys.argv[2], 8))
for runner_id in range(1, 41):
    path = os.path.join(claimed, str(runner_id))
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
    os.chmod(path, 0o666)
"""

READ_CLAIMS = """
found = {}
for name in sorted(os.listdir(sys.argv[1])):
    try:
        with open(os.path.join(sys.argv[1], name), "rb") as fh:
            found[name] = len(fh.read())
    except OSError as exc:
        found[name] = exc.strerror
print(json.dumps(found))
"""

# Truncates every claim file it can write, over and over, while the runner works.
TRUNCATE = """
while True:
    for name in os.listdir(sys.argv[1]):
        try:
            os.truncate(os.path.join(sys.argv[1], name), 0)
        except OSError:
            pass
    time.sleep(0.001)
"""


@pytest.mark.timeout(90)
def test_claim_files_planted_by_another_user_are_never_written(other_user, base, tmp_path):
    """The other user creates the claimed-runs directory (0777 in the public directory; the
    group's 2770 in the group directory) and a file for every runner id a fresh database
    hands out; a batched runner must neither write its claims into them (the other user
    would read run ids and started counts, and by truncating a file mapped in the runner's
    memory kill it with SIGBUS) nor leave one the other user can read."""
    import json
    database = Database("sqlite", tmp_path)
    claimed = claimfile.directory(wakeup.directory(database.url, base))
    run_as(other_user, PLANT_CLAIMS, claimed, "777" if stat.S_IMODE(
        os.stat(base).st_mode) & 0o1000 else "2770")
    config = database.write_config(tmp_path / "c.toml", '[runner]\nbatch = 4\npoll_interval '
                                   '= 0.2\nwakeup_dir = "%s"\n' % base)
    queue = database.queue()
    ids = [queue.add_task(ECHO) for _ in range(12)]
    log_path = tmp_path / "runner.log"
    runner = spawn("runner", config=config, log_path=log_path)
    try:
        wait_for(lambda: Task.get_by_id(ids[0]).last_status == SUCCESS, timeout=20,
                 message="the first task to run")
        seen = json.loads(run_as(other_user, READ_CLAIMS, claimed).stdout)
        argv, options = as_user(other_user, TRUNCATE, [claimed])
        truncating = subprocess.Popen(argv, **options)
        try:
            for _ in range(3):
                ids = [queue.add_task(ECHO) for _ in range(12)]
                wait_for(lambda: all(Task.get_by_id(i).last_status == SUCCESS for i in ids)
                         or runner.poll() is not None, timeout=40, message="the tasks to run")
                assert runner.poll() is None, "the runner died: %s" % log_path.read_text()
        finally:
            truncating.kill()
            truncating.wait()
    finally:
        stop_process(runner, signal.SIGTERM)
        queue.close()
    written = {name: size for name, size in seen.items() if size not in (0, "Permission denied")}
    assert not written, "the other user read claims: %s" % written
    assert runner.returncode == 0, log_path.read_text()


ATTACKER_HUB = """
import select
directory = sys.argv[1]
os.mkdir(directory)
os.chmod(directory, 0o777)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind(os.path.join(directory, "hub"))
os.chmod(os.path.join(directory, "hub"), 0o777)
print("ready", flush=True)
heard = []
while sys.stdin not in select.select([sock, sys.stdin], [], [])[0]:
    heard.append(sock.recv(256).decode())
print(json.dumps(heard), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_hub_planted_by_another_user_hears_nothing(other_user, tmp_path):
    """The other user creates the wake-up directory (0777) in /tmp-like public directory
    and binds a socket in the hub's place: the victim's runners and `add` must not tell it
    anything (queue names, counts, idle runners), and the tasks still run (by polling)."""
    import json
    base = tempfile.mkdtemp(prefix="trsec-")
    os.chmod(base, 0o1777)
    database = Database("sqlite", tmp_path)
    directory = wakeup.directory(database.url, base)
    argv, options = as_user(other_user, ATTACKER_HUB, [directory])
    attacker = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **options)
    config = database.write_config(tmp_path / "c.toml", '[runner]\npoll_interval = 0.3\n'
                                   'wakeup_dir = "%s"\n' % base)
    queue = database.queue(runner={"wakeup_dir": base})
    runner = None
    try:
        assert attacker.stdout.readline().strip() == "ready", attacker.stderr.read()
        runner = spawn("runner", config=config, log_path=tmp_path / "runner.log")
        for _ in range(3):
            task_id = queue.add_task(ECHO, queue="secret-queue")
            wait_for(lambda: Task.get_by_id(task_id).last_status == SUCCESS, timeout=20,
                     message="the task to run")
        heard = json.loads(attacker.communicate("done\n", timeout=30)[0].splitlines()[-1])
    finally:
        if runner is not None:
            stop_process(runner, signal.SIGTERM)
        attacker.kill()
        queue.close()
        subprocess.run(["rm", "-rf", base], check=False)
    assert heard == [], "the other user's hub heard %d datagram(s): %s" % (len(heard),
                                                                         heard[:3])
    assert "not this user's own" in (tmp_path / "runner.log").read_text()


IDLE_INTRUDER = """
home = sys.argv[2]
os.mkdir(home, 0o700)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind(os.path.join(home, "intruder.sock"))
sock.sendto(b"i *", sys.argv[1])
print("sent", flush=True)
sock.settimeout(float(sys.argv[3]))
try:
    print(json.dumps([sock.recv(64).decode()]), flush=True)
except socket.timeout:
    print("[]", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_hub_hears_only_its_own_user_and_group(other_user, tmp_path):
    """An operator's `chmod -R o+rX` makes the hub's socket reachable by anyone after it was
    bound: the hub must still take no datagram from a user outside its own and its
    directory's group (peer credentials), so another user cannot pose as an idle runner
    and take the wake-ups meant for this user's runners."""
    import json
    from taskrunner.host.hub import Hub
    base = tempfile.mkdtemp(prefix="trsec-")
    public = tempfile.mkdtemp(prefix="trsec-")
    os.chmod(public, 0o1777)
    directory = wakeup.directory("sqlite:////nonexistent/q.db", base)
    hub = Hub(directory)
    try:
        assert hub.take()
        for path, mode in ((base, 0o755), (directory, 0o755), (hub.path, 0o666)):
            os.chmod(path, mode)
        argv, options = as_user(other_user, IDLE_INTRUDER,
                                [hub.path, os.path.join(public, "home"), "2"])
        intruder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **options)
        assert intruder.stdout.readline().strip() == "sent"
        quiet, unused = os.pipe()          # the hub process's signal pipe, never written
        hub.sleep(quiet, 0.5)              # serve what arrives meanwhile
        os.close(quiet)
        os.close(unused)
        hub.wake(1, "default")
        heard = json.loads(intruder.communicate(timeout=20)[0].strip())
    finally:
        hub.close()
        subprocess.run(["rm", "-rf", base, public], check=False)
    assert heard == [], "the hub woke another user's socket: %s" % heard
    assert not hub.idle
