"""Timers of periodic tasks: systemd calendar events (``Mon..Fri *-*-* 07:30``), fixed
intervals (``every 30s``: anchor + k * interval, no drift) and spans after the previous task
finished (``after 5min``: TimescaleDB's schedule_interval). ``next_after(base, anchor)`` is
the first due time after `base`; naive UTC in and out."""
import math
from datetime import timedelta, timezone

from .calendar import CalendarError, parse_calendar
from .errors import InputError
from .timespan import parse_timespan


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

    def __init__(self, event):
        self.event = event
        self.normalized = event.normalized

    def next_after(self, base, anchor=None):
        elapse = self.event.next_after(base.replace(tzinfo=timezone.utc))
        return None if elapse is None else elapse.astimezone(timezone.utc).replace(tzinfo=None)


def parse_timer(text):
    """A timer from its text; InputError says what is wrong."""
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
        return CalendarTimer(parse_calendar(stripped))
    except CalendarError as exc:
        raise InputError("invalid timer %r: %s" % (text, exc)) from None
