"""periodic_tasks.timezone: the zone a calendar timer written without one is evaluated in,
fixed when it is defined, so overseers under different local zones compute the same due
times (before, each evaluated it in its own local zone).

Existing calendar timers that name no zone get the local zone of the process applying this
migration ($TZ, else /etc/localtime, by its IANA name; UTC when it has none): the zone they
were most likely being evaluated in. A timer names no zone when it is one word (``daily``,
``Sat,Sun``) or its last word has no letter (``Mon..Fri 07:30``).
"""
import os


def _local_zone_name():
    name = os.environ.get("TZ")
    if name is None:
        real = os.path.realpath("/etc/localtime")
        name = real.split("/zoneinfo/", 1)[1] if "/zoneinfo/" in real else ""
    name = name.lstrip(":")
    if "/zoneinfo/" in name:
        name = name.split("/zoneinfo/", 1)[1]
    try:
        from zoneinfo import ZoneInfo
        ZoneInfo(name)
    except (KeyError, ValueError, OSError):  # no IANA name: "", a POSIX rule string
        return "UTC"
    return name


def _names_no_zone(timer):
    words = timer.split()
    return len(words) == 1 or not any(c.isalpha() for c in words[-1])


def up(migrator, db):
    db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN timezone VARCHAR(64) NULL")
    zone = _local_zone_name()
    param = db.param
    rows = db.execute_sql("SELECT id, timer FROM periodic_tasks").fetchall()
    for row_id, timer in rows:
        if not timer.strip().lower().startswith("every ") and _names_no_zone(timer):
            db.execute_sql("UPDATE periodic_tasks SET timezone = %s WHERE id = %s"
                           % (param, param), (zone, row_id))
