"""``taskrunner calendar``: the next elapses of any timer a periodic task accepts — a
calendar event, as ``systemd-analyze calendar`` shows it, ``every SPAN``, or ``after SPAN``
(shown as if each task took no time: its due times then follow the same grid). Output
streams: each elapse is printed as it is computed. Imports no database code."""
import argparse
import itertools
import sys
from datetime import datetime, timedelta, timezone

from ..calendar import CalendarError, iter_analyze, iter_json, parse_calendar
from ..errors import InputError
from ..timespan import parse_every

MAX_ITERATIONS = 10 ** 9


class IntervalEvent:
    """``every SPAN`` as the calendar output sees an event: due base + k * SPAN, k >= 1,
    which is when a periodic task defined at `base` with this timer is due."""

    def __init__(self, text, seconds):
        self.original = text
        self.normalized = "%s %s" % (text.strip()[:5].lower(), text.strip()[6:].strip())
        self.seconds = seconds
        self.tz = timezone.utc

    def elapses_usec(self, base):
        start = base.astimezone(timezone.utc) if base.tzinfo else base.replace(tzinfo=timezone.utc)
        epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
        base_usec = (start - epoch) // timedelta(microseconds=1)
        step = round(self.seconds * 1e6)
        for k in itertools.count(1):
            usec = base_usec + k * step
            if usec >= 253402300800 * 10 ** 6:      # year 10000: past what a datetime holds
                return
            yield usec

    def as_datetime(self, usec):
        return datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=usec)


def parse_event(text):
    """A calendar event or an interval; InputError says what is wrong."""
    try:
        seconds = parse_every(text)
    except ValueError as exc:
        raise InputError("invalid timer %r: %s" % (text, exc)) from None
    if seconds is not None:
        return IntervalEvent(text, seconds)
    try:
        return parse_calendar(text)
    except CalendarError as exc:
        raise InputError(str(exc)) from None


def iterations(text):
    """-n: a whole number from 0 to MAX_ITERATIONS."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_ITERATIONS:
        raise argparse.ArgumentTypeError("expected a whole number from 0 to %d, got %r"
                                         % (MAX_ITERATIONS, text))
    return value


def cmd_calendar(args):
    event = parse_event(args.expression)
    base = args.base or datetime.now(timezone.utc)
    pieces = iter_json(event, base, args.iterations) if args.json \
        else (line + "\n" for line in iter_analyze(event, base, args.iterations))
    for piece in pieces:
        sys.stdout.write(piece)
        if not args.json:
            sys.stdout.flush()
    if args.json:
        sys.stdout.write("\n")
