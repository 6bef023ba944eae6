"""Host identity in runner rows, and migration 0007's zone for timers defined before it."""
import sqlite3
import subprocess
import sys

from conftest import process_env

from taskrunner.fleet import liveness
from taskrunner.config import Config
from taskrunner.store.bound import Store


def test_host_id_is_configurable(sqlite_db):
    store = Store(Config.from_dict({"database": {"url": sqlite_db.url},
                                    "runner": {"host_id": "web-1"}}))
    row = liveness.register(store)
    assert store.Runner.get_by_id(row.id).host == "web-1"
    assert liveness.others_running(store, parent_id=-1) == 1   # it holds a slot of web-1
    store.close()
    default = Store(Config.from_dict({"database": {"url": sqlite_db.url}}))
    assert liveness.host_id(default) == liveness.default_host_id()
    assert liveness.others_running(default, parent_id=-1) == 0  # another host's runner
    default.close()


MIGRATE = """
import sys
from taskrunner.config import Config
from taskrunner.store.bound import Store
print(Store(Config.load(database_url=sys.argv[1])).migrate())
"""


def test_migration_0007_gives_existing_zoneless_calendar_timers_the_local_zone(sqlite_db):
    """Rows from before 0007 were evaluated in each overseer's local zone; they get the zone of
    the process applying the migration, and intervals and timers with a zone get none."""
    path = sqlite_db.url[len("sqlite:///"):]
    with sqlite3.connect(path) as con:
        con.execute("ALTER TABLE periodic_tasks DROP COLUMN timezone")
        con.execute("DELETE FROM taskrunner_migrations WHERE name = '0007_periodic_timezone'")
        for name, timer in (("standup", "Mon..Fri 07:30"), ("daily", "daily"),
                            ("nyc", "Mon 07:30 America/New_York"), ("utc", "07:30 UTC"),
                            ("tick", "every 5min")):
            con.execute("INSERT INTO periodic_tasks (name, enabled, handler, data, priority, "
                        "timer, created, catch_up, source, consecutive_failures, "
                        "submitted_count, skipped_count, crash_count, updated_on) VALUES "
                        "(?, 1, 'taskrunner.handlers.Echo', 'null', 0, ?, '2026-01-01', "
                        "'once', 'api', 0, 0, 0, 0, '2026-01-01')", (name, timer))
    done = subprocess.run([sys.executable, "-c", MIGRATE, sqlite_db.url], capture_output=True,
                          text=True, timeout=60, env=process_env({"TZ": "Europe/Berlin"}),
                          check=False)
    assert done.returncode == 0 and "0007_periodic_timezone" in done.stdout, done.stderr
    with sqlite3.connect(path) as con:
        zones = dict(con.execute("SELECT name, timezone FROM periodic_tasks"))
    assert zones == {"standup": "Europe/Berlin", "daily": "Europe/Berlin", "nyc": None,
                     "utc": None, "tick": None}
