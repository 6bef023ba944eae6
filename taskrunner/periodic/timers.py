"""Timers of periodic tasks: systemd calendar events (``Mon..Fri *-*-* 07:30``), fixed
intervals (``every 30s``: anchor + k * interval, no drift) and spans after the previous task
finished (``after 5min``: TimescaleDB's schedule_interval). ``next_after(base, anchor)`` is
the first due time after `base`; naive UTC in and out.

A calendar timer written without a zone is stored with the zone it was defined in
(``timezone``: the defining process's local zone, by its IANA name, else UTC), so every host
computes the same instants from it."""
import math
import re
from datetime import timedelta, timezone

from ..calendar import CalendarError, parse_calendar
from ..calendar.zones import local_zone, named_zone
from ..errors import InputError
from ..timespan import parse_timespan


class IntervalTimer:
    """``every SPAN``: due times anchor + k * interval."""
    after_finish = False

    def __init__(self, seconds, text):
        self.seconds = seconds
        self.normalized = "every %s" % text

    def next_after(self, base, anchor=None):
        if anchor is None or anchor > base:
            return base + timedelta(seconds=self.seconds) if anchor is None else anchor
        steps = math.floor((base - anchor).total_seconds() / self.seconds) + 1
        return anchor + timedelta(seconds=steps * self.seconds)


class AfterFinishTimer(IntervalTimer):
    """``after SPAN``: due SPAN after the previous task finished (TimescaleDB's
    schedule_interval); the scheduler and the outcome hook set nextrun from that finish.
    Before the first task: SPAN after the periodic task was created or enabled."""
    after_finish = True

    def __init__(self, seconds, text):
        super().__init__(seconds, text)
        self.normalized = "after %s" % text

    def next_after(self, base, anchor=None):
        return base + timedelta(seconds=self.seconds)


class CalendarTimer:
    after_finish = False

    def __init__(self, event, zone=None):
        self.event = event
        self.normalized = event.normalized
        self.zone = zone  # the zone added to a text that named none, or None

    def next_after(self, base, anchor=None):
        elapse = self.event.next_after(base.replace(tzinfo=timezone.utc))
        return None if elapse is None else elapse.astimezone(timezone.utc).replace(tzinfo=None)


def local_zone_name():
    """This process's local zone ($TZ, else /etc/localtime) by its IANA name; "UTC" when it
    has none another host could look up (a POSIX rule string, an unnamed file)."""
    key = getattr(local_zone().tz, "key", None) or ""
    if "/zoneinfo/" in key:
        key = key.split("/zoneinfo/", 1)[1]
    return key if key and named_zone(key) is not None else "UTC"


def _names_zone(event):
    """Whether a calendar event carries its own zone: its normalized form then ends in it
    (UTC, an IANA name or a local abbreviation) rather than in the seconds field."""
    return re.search(r"[A-Za-z]", event.normalized.rsplit(" ", 1)[-1]) is not None


def timer_zone(text):
    """The zone a timer is stored with when defined now: the local zone's name for a
    calendar timer that names none, else None (an interval, or a zone of its own)."""
    timer = parse_timer(text)
    return local_zone_name() if isinstance(timer, CalendarTimer) and timer.zone is None \
        and not _names_zone(timer.event) else None


def parse_timer(text, zone=None):
    """A timer from its text, a calendar event evaluated in `zone` (an IANA name or "UTC")
    when the text names no zone of its own; InputError says what is wrong. A zone written
    as a local abbreviation ("CET") is refused: another host's local zone may not know it."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("invalid timer %r: expected a calendar event, 'every SPAN' or "
                         "'after SPAN'" % (text,))
    stripped = text.strip()
    for prefix, kind in (("every ", IntervalTimer), ("after ", AfterFinishTimer)):
        if not stripped.lower().startswith(prefix):
            continue
        span = stripped[len(prefix):].strip()
        try:
            seconds = parse_timespan(span)
        except ValueError as exc:
            raise InputError("invalid timer %r: %s" % (text, exc)) from None
        if seconds < 1:
            raise InputError("invalid timer %r: the interval must be at least 1s" % text)
        return kind(seconds, span)
    try:
        event = parse_calendar(stripped)
        if not _names_zone(event):
            return CalendarTimer(parse_calendar("%s %s" % (stripped, zone)), zone) \
                if zone else CalendarTimer(event)
    except CalendarError as exc:
        raise InputError("invalid timer %r: %s" % (text, exc)) from None
    last = stripped.rsplit(" ", 1)[-1]
    if last.lower() != "utc" and named_zone(last) is None:
        raise InputError("invalid timer %r: write the zone as an IANA name (Europe/Berlin) or "
                         "UTC; %r means different zones on different hosts" % (text, last))
    return CalendarTimer(event)
