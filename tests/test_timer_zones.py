"""A timer means the same instant on every host: a calendar timer written without a zone is
stored with the zone it was defined in, and schedulers under different local zones (TZ)
compute the same due times from it. Each scheduler runs in a process of its own, because
the local zone is the process's."""
import json
import subprocess
import sys
from datetime import datetime

from conftest import process_env, taskrunner, usage_error

from taskrunner.store.models import PeriodicTask

ECHO = "taskrunner.handlers.Echo"
ZONES = ("UTC", "Europe/Berlin", "America/New_York")
# Monday 23 November 2026, 07:30 in Berlin (CET, UTC+1), and the next weekday's.
DUE = datetime(2026, 11, 23, 6, 30)
NEXT = datetime(2026, 11, 24, 6, 30)

FIRE = """
import sys
from datetime import datetime
from taskrunner import TaskQueue
from taskrunner.config import Config
from taskrunner.periodic import PeriodicScheduler
queue = TaskQueue(Config.load(database_url=sys.argv[1]))
PeriodicTask = queue.store.PeriodicTask
due = datetime.fromisoformat(sys.argv[2])
PeriodicTask.update(nextrun=due).where(PeriodicTask.name == "standup").execute()
PeriodicScheduler(queue.store).run_pending(now=due)
print(PeriodicTask.get(PeriodicTask.name == "standup").nextrun.isoformat())
"""

SYNC = """
import sys
from taskrunner import TaskQueue
from taskrunner.config import Config
from taskrunner.periodic import sync_definitions
queue = TaskQueue(Config.load(sys.argv[1]))
sync_definitions(queue.store)
"""


def _under(zone, code, *argv):
    done = subprocess.run([sys.executable, "-c", code] + list(argv), capture_output=True,
                          text=True, timeout=60, env=process_env({"TZ": zone}), check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_three_schedulers_under_three_zones_compute_the_same_nextrun(sqlite_db):
    sqlite_db.queue()
    added = taskrunner("--database", sqlite_db.url, "periodic", "add", "standup", ECHO,
                       "Mon..Fri 07:30", env={"TZ": "Europe/Berlin"})
    assert added.returncode == 0, added.stderr
    row = PeriodicTask.get(PeriodicTask.name == "standup")
    assert (row.timer, row.timezone) == ("Mon..Fri 07:30", "Europe/Berlin")
    nextruns = {zone: _under(zone, FIRE, sqlite_db.url, DUE.isoformat()) for zone in ZONES}
    assert set(nextruns.values()) == {NEXT.isoformat()}, nextruns


def test_the_zone_is_shown_by_periodic_list(sqlite_db):
    sqlite_db.queue()
    for name, timer in (("standup", "Mon..Fri 07:30"), ("nyc", "Mon..Fri 07:30 America/New_York"),
                        ("tick", "every 5min")):
        assert taskrunner("--database", sqlite_db.url, "periodic", "add", name, ECHO, timer,
                          env={"TZ": "Europe/Berlin"}).returncode == 0
    listed = json.loads(taskrunner("--database", sqlite_db.url, "periodic", "list", "--json",
                                   check=True).stdout)
    zones = {r["name"]: (r["timer"], r["timezone"]) for r in listed}
    assert zones == {"standup": ("Mon..Fri 07:30", "Europe/Berlin"),
                     "nyc": ("Mon..Fri 07:30 America/New_York", None),
                     "tick": ("every 5min", None)}
    table = taskrunner("--database", sqlite_db.url, "periodic", "list", "--wide", check=True).stdout
    assert "Mon..Fri 07:30 Europe/Berlin" in table


def test_overseers_syncing_one_config_under_three_zones_keep_the_first_zone(sqlite_db, tmp_path):
    sqlite_db.queue()
    config = sqlite_db.write_config(tmp_path / "c.toml", '[[periodic]]\nname = "standup"\n'
                                    'handler = "%s"\ntimer = "Mon..Fri 07:30"\n' % ECHO)
    _under("Europe/Berlin", SYNC, config)
    first = PeriodicTask.get(PeriodicTask.name == "standup")
    assert first.timezone == "Europe/Berlin"
    for zone in ZONES:
        _under(zone, SYNC, config)
        row = PeriodicTask.get(PeriodicTask.name == "standup")
        assert (row.timezone, row.nextrun, row.updated_on) == (
            "Europe/Berlin", first.nextrun, first.updated_on), zone


def test_a_zone_written_as_a_local_abbreviation_is_refused(sqlite_db):
    sqlite_db.queue()
    result = taskrunner("--database", sqlite_db.url, "periodic", "add", "x", ECHO,
                        "Mon 07:30 EDT", env={"TZ": "America/New_York"})
    usage_error(result, "IANA name")
    assert PeriodicTask.select().count() == 0
