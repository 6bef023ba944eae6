"""Elapse times: systemd's find_next() on broken-down local time, and CalendarEvent."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Iterator, NamedTuple

from .fields import EPOCH, MAX_YEAR, USEC, Chain, Spec
from .zones import Zone


class _Broken(NamedTuple):
    """What glibc's mktime()/localtime() hand back."""

    t: int
    fields: tuple[int, int, int, int, int, int]  # year, month (1-12), day, hour, minute, second
    isdst: bool
    weekday: int  # Monday = 0


def _wall_seconds(fields) -> int:
    """Seconds since the epoch of a wall-clock time read as UTC; fields may be out of range."""
    year, month, day, hour, minute, second = fields
    year, month = year + (month - 1) // 12, (month - 1) % 12 + 1
    days = datetime(year, month, 1).toordinal() - 719163 + day - 1
    return days * 86400 + hour * 3600 + minute * 60 + second


class _Clock:
    """localtime() and mktime() for one zone, with glibc's mktime() quirks.

    glibc's mktime() starts from the UTC offset its previous call ended with and probes from
    there.  For a repeated wall-clock time that decides which instance it returns, and inside a
    DST gap it settles for whatever probe it oscillates to.  systemd's search leans on both, so
    we keep the same remembered offset and probe the same way."""

    def __init__(self, tz: tzinfo, utc: bool):
        self.tz, self.utc = tz, utc
        self.offset = 0

    def localtime(self, t: int) -> _Broken:
        d = datetime.fromtimestamp(t, self.tz)
        fields = (d.year, d.month, d.day, d.hour, d.minute, d.second)
        return _Broken(t, fields, bool(d.dst()), d.weekday())

    def mktime(self, fields, isdst: int) -> _Broken | None:
        if self.utc:
            isdst = -1  # timegm() ignores the flag
        wall = _wall_seconds(fields)
        t = t1 = t2 = wall - self.offset
        previous_dst, probes = False, 6
        while True:
            probe = self.localtime(t)
            error = wall - _wall_seconds(probe.fields)
            if error == 0:
                break
            settle = previous_dst <= probe.isdst if isdst < 0 else bool(isdst) != probe.isdst
            if t == t1 and t != t2 and settle:
                self.offset = wall - t
                return probe  # in a gap: glibc gives up on an exact match
            probes -= 1
            if probes == 0:
                return None
            t1, t2, t, previous_dst = t2, t, t + error, probe.isdst
        if isdst >= 0 and bool(isdst) != probe.isdst:
            probe = self._with_dst_offset(wall, t, bool(isdst))
            if probe is None:
                return None
        self.offset = wall - probe.t
        return probe

    def _with_dst_offset(self, wall: int, t: int, isdst: bool) -> _Broken | None:
        """glibc: the wall time exists, but not with the requested DST flag; borrow the UTC
        offset of the nearest time (week by week, up to about 8.5 years away) that has it."""
        for delta in range(601200, 536454000 // 2 + 601200, 601200):
            for other in (t - delta, t + delta):
                near = self.localtime(other)
                if near.isdst == isdst:
                    return self.localtime(other + wall - _wall_seconds(near.fields))
        return None


_YEAR, _MONTH, _DAY, _HOUR, _MINUTE, _SECOND = range(6)
_FIELD_MIN = (None, 1, 1, 0, 0, 0)


class _Search:
    """systemd's find_next(): one pass per loop iteration over year, month, day, (weekday),
    hour, minute, second; a component that cannot match advances the one above it."""

    def __init__(self, spec: Spec, clock: _Clock):
        self.spec, self.clock = spec, clock
        self.chains = (spec.year, spec.month, spec.day, spec.hour, spec.minute, spec.second)
        self.fields: list[int] = []
        self.usec = 0
        self.isdst = -1
        # Set once a match had to be pushed past the start; from then on systemd leaves the
        # DST flag as mktime() last set it instead of re-applying the expression's.
        self.keep_dst = False

    def next_usec(self, usec: int) -> int | None:
        usec += 1
        start = self.clock.localtime(usec // USEC)
        self.fields, self.isdst, self.usec = list(start.fields), start.isdst, usec % USEC
        begin = (start.fields, self.usec)
        # systemd gives up after 1000 passes.  We search on, but the walk is deterministic, so
        # a pass that starts in a state seen before means it would go round forever.
        seen = set()
        while True:
            state = (tuple(self.fields), self.usec, self.isdst, self.keep_dst, self.clock.offset)
            if state in seen:
                return None
            seen.add(state)
            normal = self.clock.mktime(self.fields, self.isdst)
            if normal is not None:
                self.fields, self.isdst = list(normal.fields), normal.isdst
            if not self.keep_dst:
                self.isdst = self.spec.dst
            outcome = self._one_pass()
            if outcome is None:
                return None
            if not outcome:
                continue
            if (tuple(self.fields), self.usec) < begin:
                # Not after the start on the wall clock (mktime() moved it back across a DST
                # change); systemd 252 then steps one hour on, keeping minutes and seconds.
                self.fields[_HOUR] += 1
                self.keep_dst = True
                continue
            final = self.clock.mktime(self.fields, self.isdst)
            assert final is not None, "the seconds step has just resolved these very fields"
            return final.t * USEC + self.usec

    def _one_pass(self) -> bool | None:
        """True: all components match; False: moved on, try again; None: never."""
        for level, chain in enumerate(self.chains):
            current = self.fields[level] * USEC + self.usec if level == _SECOND else self.fields[level]
            found = current if chain is None else self._earliest(level, chain, current)
            if found is not None and found != current:
                if level == _SECOND:
                    self.fields[level], self.usec = divmod(found, USEC)
                else:
                    self.fields[level] = found
                    self._reset_below(level)
            bounds = None if found is None else self._within_bounds()
            if level == _YEAR:
                if bounds is None or bounds <= 0:
                    return None
                continue
            if bounds is None or bounds < 0:
                self._advance(level - 1)
                return False
            if bounds == 0:
                return False
            if level == _DAY and not self._weekday_matches():
                self._advance(_DAY)
                return False
        return True

    def _reset_below(self, level: int) -> None:
        self.fields[level + 1 :] = _FIELD_MIN[level + 1 :]
        self.usec = 0

    def _advance(self, level: int) -> None:
        self.fields[level] += 1
        self._reset_below(level)

    def _earliest(self, level: int, chain: Chain, value: int) -> int | None:
        """The smallest matching value >= value, as systemd's find_matching_component()."""
        best = None
        for r in chain:
            start, stop = r.start, r.stop
            if level == _DAY and self.spec.end_of_month:
                start, stop = self._end_of_month(r.start), self._end_of_month(r.stop)
                if stop > 0:
                    start, stop = stop, start
            if start >= value:
                candidate = start
            elif r.repeat:
                candidate = start + r.repeat * -((start - value) // r.repeat)  # round up
                if 0 <= stop < candidate:
                    continue
            else:
                continue
            if best is None or candidate < best:
                best = candidate
        return best

    def _end_of_month(self, back: int) -> int:
        """Day of month that is `back` days before the next month, or -1 when that misses."""
        year, month, _, hour, minute, second = self.fields
        # systemd asks mktime() here, at the current time of day; that moves its remembered offset
        probe = self.clock.mktime((year, month + 1, 1 - back, hour, minute, second), self.isdst)
        return probe.fields[_DAY] if probe is not None and probe.fields[_MONTH] == month else -1

    def _within_bounds(self) -> int:
        """systemd's tm_within_bounds(): 1 if the fields name an existing time as they are;
        0 if mktime() moved them forward: we continue from there with only the field below the
        first changed one reset, which is how systemd loses e.g. 03:00:00 of "*:*:0/7";
        -1 if they are out of range or were moved backward."""
        if self.fields[_YEAR] > MAX_YEAR:
            return -1
        normal = self.clock.mktime(self.fields, self.isdst)
        if normal is None:
            return -1
        moved = list(normal.fields)
        for level in range(6):
            if moved[level] != self.fields[level]:
                break
        if level < _SECOND:
            moved[level + 1] = _FIELD_MIN[level + 1]
        if moved[level] < self.fields[level]:
            return -1
        if moved[level] > self.fields[level]:
            self.fields, self.isdst = moved, normal.isdst
            return 0
        return 1

    def _weekday_matches(self) -> bool:
        if not self.spec.weekdays:
            return True
        normal = self.clock.mktime(self.fields, self.isdst)
        return normal is not None and bool(self.spec.weekdays >> normal.weekday & 1)


# -------------------------------------------------------------------------------------- events


def to_usec(moment: datetime) -> int:
    """Microseconds since the epoch; a naive datetime counts as UTC."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return (moment - EPOCH) // timedelta(microseconds=1)


class CalendarEvent:
    """A parsed calendar expression.

    original: the text as given; normalized: systemd's normalized form; tz: the zone the
    event is evaluated in (and the tzinfo of the datetimes it returns)."""

    def __init__(self, original: str, normalized: str, spec: Spec, zone: Zone):
        self.original, self.normalized = original, normalized
        self._spec, self._zone = spec, zone

    @property
    def tz(self) -> tzinfo:
        return self._zone.tz

    def __repr__(self) -> str:
        return f"<CalendarEvent {self.normalized!r}>"

    def _next_usec(self, usec: int) -> int | None:
        # systemd counts in unsigned microseconds since the epoch
        clock = _Clock(self._zone.tz, self._spec.utc)
        return _Search(self._spec, clock).next_usec(max(usec, -1))

    def elapses_usec(self, base: datetime) -> Iterator[int]:
        """The elapses strictly after base, in microseconds since the epoch, one at a time
        as they are computed (until there is none)."""
        usec = to_usec(base)
        while True:
            following = self._next_usec(usec)
            if following is None:
                return
            usec = following
            yield usec

    def iter_usec(self, base: datetime, n: int) -> list[int]:
        """Up to n elapses strictly after base, in microseconds since the epoch."""
        return list(itertools.islice(self.elapses_usec(base), max(n, 0)))

    def as_datetime(self, usec: int) -> datetime:
        """An elapse in microseconds as a datetime in the event's zone."""
        return (EPOCH + timedelta(microseconds=usec)).astimezone(self.tz)

    def next_after(self, base: datetime) -> datetime | None:
        """The first elapse strictly after base (naive = UTC); None if there is none."""
        elapses = self.iter_after(base, 1)
        return elapses[0] if elapses else None

    def iter_after(self, base: datetime, n: int) -> list[datetime]:
        """Up to n consecutive elapses strictly after base."""
        return [self.as_datetime(usec) for usec in self.iter_usec(base, n)]
