"""`taskrunner calendar`: every timer a periodic task accepts, plurals as systemd writes
them, output streamed as it is computed, zones found where zoneinfo finds them."""
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest

from taskrunner.calendar import parse_calendar, render_analyze
from taskrunner.periodic.scheduler import parse_timer

from conftest import databases_required, ok, process_env, taskrunner, usage_error

BASE = "2024-01-01T00:00:00Z"


@pytest.mark.parametrize("timer", ["every 5min", "every 1h 30min", "Every 30s", "daily",
                                   "Mon..Fri 07:30"])
def test_calendar_accepts_every_timer_a_periodic_task_accepts(timer):
    parse_timer(timer)
    out = ok(taskrunner("calendar", timer, "--base", BASE, "-n", "2", "--json"))
    assert out.count("2024-01-") == 2


def test_an_interval_timer_elapses_every_interval_after_the_base():
    out = ok(taskrunner("calendar", "every 5min", "--base", BASE, "-n", "3"))
    assert "Normalized form: every 5min" in out
    assert [line.split(": ")[1] for line in out.splitlines() if "elapse" in line or "Iter" in line] \
        == ["Mon 2024-01-01 00:05:00 UTC", "Mon 2024-01-01 00:10:00 UTC",
            "Mon 2024-01-01 00:15:00 UTC"]


@pytest.mark.parametrize("timer,message", [
    ("every 5 fortnights", "unknown unit 'fortnights'"),
    ("every 0.5s", "at least 1s"),
    ("Mon..Funday", "invalid calendar expression"),
])
def test_calendar_refuses_what_a_periodic_task_refuses(timer, message):
    usage_error(taskrunner("calendar", timer), message)


@pytest.mark.parametrize("until,text", [
    ("2024-02-10", "1 month 9 days left"),
    ("2024-03-11", "2 months 9 days left"),
    ("2025-02-03", "1 year 1 month left"),
    ("2024-01-09", "1 week 1 day left"),
    ("2024-01-16", "2 weeks 1 day left"),
])
def test_from_now_reads_in_singular_and_plural_as_systemd_writes_it(until, text):
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    report = render_analyze(parse_calendar(until + " UTC"), start, 1, now=start)
    assert report.splitlines()[-1].endswith("From now: " + text)


def test_a_huge_iteration_count_prints_as_it_computes():
    proc = subprocess.Popen([sys.executable, "-m", "taskrunner", "calendar", "minutely", "-n",
                             "100000000", "--base", BASE], stdout=subprocess.PIPE,
                            env=process_env(), text=True)
    started = time.monotonic()
    try:
        lines = [proc.stdout.readline() for _ in range(5)]
        elapsed = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert "Iter. #2: Mon 2024-01-01 00:02:00 UTC" in "".join(lines)
    assert elapsed < 20, "the first lines came after %.1fs" % elapsed


@pytest.mark.parametrize("n", ["-1", "1000000001", "99999999999999999999999", "x"])
def test_an_iteration_count_out_of_bounds_is_refused(n):
    usage_error(taskrunner("calendar", "daily", "-n", n), "expected a whole number from 0")


def _calendar_in(env, *args):
    return subprocess.run([sys.executable, "-m", "taskrunner", "calendar", *args],
                          capture_output=True, text=True, env=process_env(env), timeout=60)


def test_zones_are_found_on_zoneinfos_search_path(tmp_path):
    source = next((d for d in ("/usr/share/zoneinfo", "/usr/lib/zoneinfo")
                   if os.path.isfile(os.path.join(d, "Europe/Berlin"))), None)
    if source is None:
        pytest.skip("no system zoneinfo to copy a zone from")
    (tmp_path / "Custom").mkdir()
    shutil.copyfile(os.path.join(source, "Europe/Berlin"), tmp_path / "Custom" / "Place")
    result = _calendar_in({"PYTHONTZPATH": str(tmp_path)}, "*-*-* 07:30 Custom/Place",
                          "--base", BASE, "--json")
    assert result.returncode == 0, result.stderr
    assert "2024-01-01T07:30:00+01:00" in result.stdout


def test_zones_come_from_the_tzdata_package_without_system_zoneinfo():
    """As in a slim container: an empty tmpfs over the system's zoneinfo, in a mount
    namespace of the command's own (needs root; skipped elsewhere outside CI)."""
    pytest.importorskip("tzdata")
    script = ("for d in /usr/share/zoneinfo /usr/lib/zoneinfo /usr/share/lib/zoneinfo "
              "/etc/zoneinfo; do [ -d $d ] && mount -t tmpfs tmpfs $d; done; "
              "[ ! -e /usr/share/zoneinfo/Europe/Berlin ] || exit 99; exec \"$@\"")
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
               sys.executable, "-m", "taskrunner", "calendar", "*-*-* 07:30 Europe/Berlin",
               "--base", BASE, "--json"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=process_env(),
                                timeout=60)
    except OSError as exc:
        result = subprocess.CompletedProcess(command, 98, "", str(exc))
    if result.returncode in (1, 98, 99) and "Traceback" not in result.stderr:
        if databases_required():
            pytest.fail("cannot hide the system zoneinfo: %s (required in CI)" % result.stderr)
        pytest.skip("cannot hide the system zoneinfo: %s" % result.stderr.strip())
    assert result.returncode == 0, result.stderr
    assert "2024-01-01T07:30:00+01:00" in result.stdout
