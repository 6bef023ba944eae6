"""Time spans written like systemd.time(7) spans: ``30s``, ``5min``, ``1h 30min``, ``7d``.

Used for config durations and for interval timers (``every 5min``). A bare number is seconds.
"""
import re

_UNITS = {
    "us": 1e-6, "usec": 1e-6,
    "ms": 1e-3, "msec": 1e-3,
    "s": 1, "sec": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 604800, "week": 604800, "weeks": 604800,
    "M": 2629800, "month": 2629800, "months": 2629800,
    "y": 31557600, "year": 31557600, "years": 31557600,
}
# The longest span accepted anywhere (timeouts, backoffs, timers): a century. Longer ones,
# infinity and NaN would overflow datetime arithmetic later, far from the input.
MAX_SPAN = 100 * 31557600.0
_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)")


def parse_timespan(text):
    """Return the span in seconds (float); raise ValueError naming what is wrong."""
    if isinstance(text, bool):
        raise ValueError("expected a number of seconds or a time span like '5min'")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError("a time span cannot be negative")
        return _bounded(float(text), text)
    s = str(text).strip()
    if not s:
        raise ValueError("empty time span")
    total, pos = 0.0, 0
    while pos < len(s):
        m = _PART.match(s, pos)
        if not m or m.end() == pos:
            raise ValueError("invalid time span %r" % text)
        number, unit = m.groups()
        if unit and unit not in _UNITS:
            raise ValueError("invalid time span %r: unknown unit %r" % (text, unit))
        total += float(number) * _UNITS[unit or "s"]
        pos = m.end()
        while pos < len(s) and s[pos].isspace():
            pos += 1
    return _bounded(total, text)


def _bounded(seconds, text):
    if seconds != seconds:
        raise ValueError("%r is not a time span" % (text,))
    if seconds > MAX_SPAN:
        raise ValueError("time span %r is longer than 100 years" % (text,))
    return seconds


def parse_every(text):
    """The interval in seconds of a timer written ``every SPAN`` or ``after SPAN``, or None
    when `text` is neither; ValueError naming what is wrong with the span (an interval is at
    least 1s)."""
    stripped = text.strip() if isinstance(text, str) else ""
    if not stripped.lower().startswith(("every ", "after ")):
        return None
    seconds = parse_timespan(stripped[6:].strip())
    if seconds < 1:
        raise ValueError("the interval must be at least 1s")
    return seconds
