"""Calendar events as described in systemd.time(7), computed the way systemd 252 does.

``parse_calendar("Mon..Fri 07:30")`` returns a :class:`CalendarEvent` that knows systemd's
normalized form and computes elapse times.  The reference is ``systemd-analyze calendar``; the
tests compare against it, so where systemd's behaviour is odd we copy it on purpose.

Elapse times come from systemd's own search: walk the components from year down to seconds,
and when one does not match, jump to its next matching value (or step the next larger component)
instead of scanning.  That search runs on broken-down local time and glibc's mktime(), so which
wall-clock times are skipped in a DST gap and which instance of a repeated hour fires depend on
mktime's details; ``search._Clock`` reproduces them on top of zoneinfo.

Known differences from systemd 252:

* systemd gives up after 1000 search passes with an error ("Infinite loop in calendar
  calculation"), both for valid expressions that take long to rule out, such as
  ``*-02,04,06,09,11-31``, and for searches that really go round in circles next to a DST change.
  We search on to the end of 2199 and stop only on a real cycle; either way we answer "never".
* The local zone's own abbreviations ("CET", "EDT") are recognised as glibc's tzname[] reads in a
  fresh process; glibc changes tzname[] as a side effect of localtime(), so for zones whose names
  changed since their last DST transition (Moscow's "MSD") a long-running systemd may differ.
* Zones with leap seconds ("right/...") are computed without them, and a POSIX rule string in
  $TZ ("CET-1CEST,M3.5.0,M10.5.0/3") is not understood (UTC is used).
* The "From now" line of render_analyze() only approximates systemd's wording.

The package is split by concern: ``parse`` (the grammar, into a ``fields.Spec``), ``search``
(elapse times and :class:`CalendarEvent`), ``render`` (normalized form, analyze-style text and
JSON), ``zones`` (time zones as glibc sees them) and ``fields`` (what they share).
"""

from __future__ import annotations

from .fields import CalendarError
from .parse import parse_calendar
from .render import iter_analyze, iter_json, render_analyze, render_json
from .search import CalendarEvent

__all__ = ["CalendarError", "CalendarEvent", "iter_analyze", "iter_json", "parse_calendar",
           "render_analyze", "render_json"]
