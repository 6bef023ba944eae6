"""Calendar events as described in systemd.time(7), computed the way systemd 252 does.

``parse_calendar("Mon..Fri 07:30")`` returns a :class:`CalendarEvent` that knows systemd's
normalized form and computes elapse times.  The reference is ``systemd-analyze calendar``; the
tests compare against it, so where systemd's behaviour is odd we copy it on purpose.

Elapse times come from systemd's own search: walk the components from year down to seconds,
and when one does not match, jump to its next matching value (or step the next larger component)
instead of scanning.  That search runs on broken-down local time and glibc's mktime(), so which
wall-clock times are skipped in a DST gap and which instance of a repeated hour fires depend on
mktime's details; :class:`_Clock` reproduces them on top of zoneinfo.

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
"""

from __future__ import annotations

import functools
import io
import os
import re
import string
import struct
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import NamedTuple
from zoneinfo import ZoneInfo

__all__ = ["CalendarError", "CalendarEvent", "parse_calendar", "render_analyze", "render_json"]

_USEC = 1_000_000
_INT_MAX = 2**31 - 1
_MIN_YEAR, _MAX_YEAR = 1970, 2199
_MAX_LIST = 241  # systemd refuses longer comma lists
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MAX_TIMESTAMP = (datetime(_MAX_YEAR + 1, 1, 1, tzinfo=timezone.utc) - _EPOCH).days * 86400 - 1
_ZONEINFO_DIR = "/usr/share/zoneinfo"

_DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_WEEKDAY_WORDS = tuple(
    (word, nr)
    for nr, (full, short) in enumerate(
        zip(("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"), _DAY_NAMES)
    )
    for word in (full, short)  # systemd tries the long name first
)
_SHORTHANDS = {
    "minutely": "*-*-* *:*:00",
    "hourly": "*-*-* *:00:00",
    "daily": "*-*-* 00:00:00",
    "monthly": "*-*-01 00:00:00",
    "weekly": "Mon *-*-* 00:00:00",
    "yearly": "*-01-01 00:00:00",
    "annually": "*-01-01 00:00:00",
    "anually": "*-01-01 00:00:00",
    "quarterly": "*-01,04,07,10-01 00:00:00",
    "semiannually": "*-01,07-01 00:00:00",
    "semi-annually": "*-01,07-01 00:00:00",
    "biannually": "*-01,07-01 00:00:00",
    "bi-annually": "*-01,07-01 00:00:00",
}
_DIGITS = re.compile(r"[0-9]+")
_SPACES = re.compile(r" *")
_C_SPACE = " \t\n\v\f\r"
_ZONE_NAME = re.compile(r"[A-Za-z0-9_+-]+(?:/[A-Za-z0-9_+-]+)*\Z")
# systemd compares names with strcasecmp(), which folds ASCII only.
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _lower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


class CalendarError(ValueError):
    """An expression that systemd would refuse."""


# --------------------------------------------------------------------------------------- zones


@dataclass(frozen=True)
class _Zone:
    tz: tzinfo
    names: tuple[str, str]  # glibc's tzname[0] (standard) and tzname[1] (daylight saving)
    utc_like: bool  # glibc's "timezone == 0 && daylight == 0": systemd then omits "(in UTC)"


_UTC = _Zone(timezone.utc, ("UTC", "UTC"), True)


def _tzif_rules(data: bytes) -> tuple[tuple[str, str], bool]:
    """tzname[] and the UTC test as glibc derives them from a TZif file.

    glibc takes both from the last transition into a standard and into a daylight-saving type,
    not from the current date, so a zone that dropped DST still has a tzname[1] (Moscow: MSD).
    That is what a fresh process sees; glibc rewrites tzname[] as a side effect of localtime(),
    so a long-running systemd may no longer accept such a name."""
    header = struct.Struct(">4sc15x6l")
    _, version, isut, isstd, leaps, count, ntypes, nchars = header.unpack_from(data)
    pos, time_size = header.size, 4
    if version >= b"2":  # glibc reads the 64-bit block that follows the 32-bit one
        pos += count * 5 + ntypes * 6 + nchars + leaps * 8 + isstd + isut
        _, _, isut, isstd, leaps, count, ntypes, nchars = header.unpack_from(data, pos)
        pos, time_size = pos + header.size, 8
    pos += count * time_size
    indexes = data[pos : pos + count]
    pos += count
    types = [struct.unpack_from(">lBB", data, pos + 6 * i) for i in range(ntypes)]
    chars = data[pos + 6 * ntypes : pos + 6 * ntypes + nchars]

    def abbreviation(start: int) -> str:
        return chars[start : chars.index(b"\0", start)].decode("ascii", "replace")

    names: list[str | None] = [None, None]
    offsets: list[int | None] = [None, None]
    for index in reversed(indexes):
        offset, isdst, name_at = types[index]
        if names[bool(isdst)] is None:
            names[bool(isdst)], offsets[bool(isdst)] = abbreviation(name_at), offset
    standard = names[0] if names[0] is not None else abbreviation(0)
    daylight = names[1] if names[1] is not None else standard
    if not indexes:
        std_offset = dst_offset = types[0][0]
    else:
        std_offset = offsets[0] or 0
        dst_offset = offsets[1] if offsets[1] is not None else std_offset
    return (standard, daylight), std_offset == 0 and dst_offset == 0


@functools.lru_cache(maxsize=64)
def _load_zone(path: str, key: str | None) -> _Zone | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(b"TZif"):
            return None
        tz = ZoneInfo.from_file(io.BytesIO(data), key=key)
        names, utc_like = _tzif_rules(data)
    except (OSError, ValueError, struct.error, IndexError):
        return None
    return _Zone(tz, names, utc_like)


def _local_zone() -> _Zone:
    """The zone glibc would use: $TZ, else /etc/localtime, else UTC.

    POSIX rule strings in $TZ (like "CET-1CEST,M3.5.0,M10.5.0/3") are not supported and
    fall back to UTC."""
    value = os.environ.get("TZ")
    if value == "":
        return _UTC
    name = (value or "")[1:] if (value or "").startswith(":") else value
    if not name:
        real = os.path.realpath("/etc/localtime")
        key = os.path.relpath(real, _ZONEINFO_DIR) if real.startswith(_ZONEINFO_DIR + "/") else None
        return _load_zone("/etc/localtime", key) or _UTC
    path = name if name.startswith("/") else os.path.join(_ZONEINFO_DIR, name)
    return _load_zone(path, name) or _UTC


def _named_zone(name: str) -> _Zone | None:
    """An IANA zone suffix, accepted under the same rules as systemd's verify_timezone()."""
    if not _ZONE_NAME.match(name):
        return None
    path = os.path.join(_ZONEINFO_DIR, name)
    return _load_zone(path, name) if os.path.isfile(path) else None


# ----------------------------------------------------------------------------------- the spec


class _Range(NamedTuple):
    """start, start+repeat, ... up to stop (-1: no limit); repeat 0 means just start.

    Seconds are kept in microseconds.  With '~' days count back from the end of the month."""

    start: int
    stop: int
    repeat: int


_Chain = tuple  # tuple[_Range, ...]; None stands for "*"


@dataclass(frozen=True)
class _Spec:
    weekdays: int  # bit 0 = Monday; 0 = any day
    year: _Chain | None
    month: _Chain | None
    day: _Chain | None
    hour: _Chain | None
    minute: _Chain | None
    second: _Chain  # microseconds; systemd always has this one
    end_of_month: bool
    utc: bool
    zone_name: str | None
    dst: int  # -1, or 0/1 when the local zone's standard/daylight name was given


def _normalize_chain(ranges: list[list[int]] | None) -> _Chain | None:
    if ranges is None:
        return None
    result = set()
    for start, stop, repeat in ranges:
        if stop > start and repeat > 0:
            stop -= (stop - start) % repeat  # "1..10/4" is "1..9/4"
        if (stop > start and repeat > 0 and start + repeat > stop) or start == stop:
            stop, repeat = -1, 0  # "5..5" and "1..5/10" are just "5" and "1"
        result.add(_Range(start, stop, repeat))
    return tuple(sorted(result))


def _show(value: int, usec: bool) -> str:
    if not usec:
        return str(value)
    whole, fraction = divmod(value, _USEC)
    return f"{whole}.{fraction:06d}".rstrip("0") if fraction else str(whole)


def _chain_problem(
    chain: _Chain | None, what: str, low: int, high: int, usec: bool = False, eom: bool = False
) -> str | None:
    for r in chain or ():
        if eom:
            # '~' counts back at most 28 days, and systemd lowers that limit by 3 again for
            # every further list item (so "~10,1..2,23" is refused); it decides what parses.
            high -= 3
        bounds = f"{_show(low, usec)}..{_show(high, usec)}"
        for value in (r.start, r.stop) if r.stop >= 0 else (r.start,):
            if not low <= value <= high:
                return f"{what} {_show(value, usec)} is out of range {bounds}"
        if r.repeat > high - low:
            return f"repetition /{_show(r.repeat, usec)} is too large for {what}"
        if r.stop >= 0 and r.start + r.repeat > r.stop:
            return f"{what} range {_show(r.start, usec)}..{_show(r.stop, usec)} is empty"
        if r.stop < 0 and (r.start - r.repeat < low if eom else r.start + r.repeat > high):
            return f"{what} {_show(r.start, usec)}/{_show(r.repeat, usec)} never repeats within {bounds}"
    return None


def _format_chain(chain: _Chain | None, width: int, usec=False) -> str:
    # systemd 252 shows the whole seconds list as "*" when any item is "every second"
    if chain is None or (usec and (0, -1, _USEC) in chain):
        return "*"
    unit = _USEC if usec else 1
    parts = []
    for start, stop, repeat in chain:
        text = f"{start // unit:0{width}d}" + (f".{start % unit:06d}" if start % unit else "")
        if stop > 0:
            text += f"..{stop // unit:0{width}d}" + (f".{stop % unit:06d}" if stop % unit else "")
        if repeat > 0 and not (stop > 0 and repeat == unit):  # a plain range steps by one unit
            text += f"/{repeat // unit}" + (f".{repeat % unit:06d}" if repeat % unit else "")
        parts.append(text)
    return ",".join(parts)


def _format_weekdays(bits: int) -> str:
    runs = []  # [first, last] day numbers of consecutive days
    for day in range(7):
        if bits >> day & 1:
            if runs and runs[-1][1] == day - 1:
                runs[-1][1] = day
            else:
                runs.append([day, day])
    parts = []
    for first, last in runs:
        if last - first >= 2:
            parts.append(f"{_DAY_NAMES[first]}..{_DAY_NAMES[last]}")
        else:
            parts.extend(_DAY_NAMES[first : last + 1])
    return ",".join(parts)


def _spec_to_string(spec: _Spec, local: _Zone) -> str:
    text = _format_weekdays(spec.weekdays) + " " if spec.weekdays else ""
    text += (
        f"{_format_chain(spec.year, 4)}-{_format_chain(spec.month, 2)}"
        f"{'~' if spec.end_of_month else '-'}{_format_chain(spec.day, 2)} "
        f"{_format_chain(spec.hour, 2)}:{_format_chain(spec.minute, 2)}:"
        f"{_format_chain(spec.second, 2, usec=True)}"
    )
    if spec.utc:
        return text + " UTC"
    if spec.zone_name:
        return f"{text} {spec.zone_name}"
    if spec.dst >= 0 and local.names[spec.dst]:
        return f"{text} {local.names[spec.dst]}"
    return text


# --------------------------------------------------------------------------------------- parser


class _Parser:
    """systemd's calendar_spec_from_string(): a hand-written scanner over one string."""

    def __init__(self, expr: str, text: str):
        self.expr, self.s = expr, text
        self.weekdays = 0
        names = ("year", "month", "day", "hour", "minute")
        self.chains: dict[str, list[list[int]] | None] = dict.fromkeys(names)
        self.second: list[list[int]] = []
        self.end_of_month = False
        self.utc = False

    def fail(self, reason: str) -> CalendarError:
        return CalendarError(f"invalid calendar expression {self.expr!r}: {reason}")

    def rest(self, i: int) -> str:
        return repr(self.s[i:]) if i < len(self.s) else "end of expression"

    def parse(self) -> None:
        s = self.s
        i = self.parse_weekdays(0)
        start_of_date = i
        try:
            i, complete = self.parse_date(i)
            if not complete:
                i = self.parse_time(i)
        except CalendarError:
            word = s.split(" ")[0]
            if start_of_date == 0 and _lower(word) in _SHORTHANDS:
                raise self.fail(f"{word!r} cannot be combined with anything but a time zone") from None
            if start_of_date == 0 and s[:1].isascii() and s[:1].isalpha():
                raise self.fail(f"unknown weekday or keyword {word!r}") from None
            raise
        if i != len(s):
            raise self.fail(f"unexpected {self.rest(i)}")

    def parse_weekdays(self, i: int) -> int:
        s, bits, range_from, first = self.s, 0, -1, True
        while True:
            for word, nr in _WEEKDAY_WORDS:
                if _lower(s[i : i + len(word)]) == _lower(word):
                    break
            else:
                if first:
                    return i  # no weekday given
                raise self.fail(f"expected a weekday at {self.rest(i)}")
            i += len(word)
            if i < len(s) and s[i] not in "-., ":
                raise self.fail(f"unknown weekday {s[i - len(word):].split(' ')[0]!r}")
            bits |= 1 << nr
            if range_from >= 0:
                if range_from > nr:
                    backwards = f"{_DAY_NAMES[range_from]}..{_DAY_NAMES[nr]}"
                    raise self.fail(f"weekday range {backwards} goes backwards")
                bits |= (1 << nr) - (1 << range_from)
            self.weekdays = bits
            if i == len(s) or s[i] == " ":
                return _SPACES.match(s, i).end()
            if s[i] in ".-":
                if range_from >= 0:
                    raise self.fail("a weekday range cannot continue into another range")
                if s[i] == "." and not s.startswith("..", i):
                    raise self.fail(f"expected '..' at {self.rest(i)}")
                range_from = nr
                i += 2 if s[i] == "." else 1
            else:  # ','
                range_from = -1
                i += 1
            if i == len(s) or s[i] == " ":
                if range_from >= 0:
                    raise self.fail("weekday range has no end")
                return _SPACES.match(s, i).end()
            first = False

    def parse_number(self, i: int, usec: bool) -> tuple[int, int]:
        begin, match = i, _DIGITS.match(self.s, i)
        if not match:
            raise self.fail(f"expected a number at {self.rest(i)}")
        value, i = int(match.group()), match.end()
        if usec:
            value *= _USEC
            if self.s.startswith(".", i) and not self.s.startswith("..", i):
                match = _DIGITS.match(self.s, i + 1)
                if not match:
                    raise self.fail("expected digits after the decimal point")
                digits, i = match.group(), match.end()
                # systemd keeps six digits and rounds on the seventh alone
                value += int(digits[:6].ljust(6, "0")) + (len(digits) > 6 and digits[6] >= "5")
        if value > _INT_MAX:
            raise self.fail(f"number {self.s[begin:i]} is too large")
        return value, i

    def parse_chain(self, i: int, usec: bool) -> tuple[list[list[int]] | None, int]:
        if self.s.startswith("*", i):
            return ([[0, -1, _USEC]] if usec else None), i + 1
        ranges: list[list[int]] = []
        while True:
            if len(ranges) == _MAX_LIST:
                raise self.fail(f"more than {_MAX_LIST} values in a list")
            start, i = self.parse_number(i, usec)
            stop, repeat = -1, 0
            if self.s.startswith("..", i):
                stop, i = self.parse_number(i + 2, usec)
                repeat = _USEC if usec else 1
            if self.s.startswith("/", i):
                repeat, i = self.parse_number(i + 1, usec)
                if repeat == 0:
                    raise self.fail("repetition must not be zero")
            elif usec and stop >= 0 and start + repeat > stop:
                raise self.fail("a seconds range without repetition must span at least one second")
            if i < len(self.s) and self.s[i] not in " ,-~:":
                raise self.fail(f"unexpected {self.rest(i)}")
            ranges.append([start, stop, repeat])
            if not self.s.startswith(",", i):
                return ranges, i
            i += 1

    def parse_date(self, i: int) -> tuple[int, bool]:
        """Returns the position after the date, and whether the expression is complete."""
        s = self.s
        if i == len(s):
            return i, False
        if s[i] == "@":
            return self.parse_timestamp(i + 1), True
        first, j = self.parse_chain(i, False)
        if j == len(s) or s[j] == ":":
            return i, False  # that was the hour
        j = self.parse_date_separator(j)
        second, j = self.parse_chain(j, False)
        if j == len(s) or s[j] == " ":
            self.chains["month"], self.chains["day"] = first, second
            return _SPACES.match(s, j).end(), False
        if self.end_of_month:
            raise self.fail("'~' must separate month and day")
        j = self.parse_date_separator(j)
        third, j = self.parse_chain(j, False)
        if j < len(s) and s[j] != " ":
            raise self.fail(f"unexpected {self.rest(j)} after date")
        self.chains["year"], self.chains["month"], self.chains["day"] = first, second, third
        return _SPACES.match(s, j).end(), False

    def parse_date_separator(self, j: int) -> int:
        if self.s[j] == "~":
            self.end_of_month = True
        elif self.s[j] != "-":
            raise self.fail(f"unexpected {self.rest(j)} in date")
        return j + 1

    def parse_timestamp(self, i: int) -> int:
        # as strtoul(): leading white space and a sign are allowed, and "-N" wraps around
        s = self.s
        while i < len(s) and s[i] in _C_SPACE:
            i += 1
        sign = s[i : i + 1] if s[i : i + 1] in ("+", "-") else ""
        match = _DIGITS.match(s, i + len(sign))
        if not match:
            raise self.fail("expected seconds since the epoch after '@'")
        value = int(match.group())
        if value >= 2**64:
            raise self.fail(f"timestamp {match.group()} is too large")
        seconds = (-value if sign == "-" else value) % 2**64
        if seconds > _MAX_TIMESTAMP:  # this includes the negative ones, as time_t
            raise self.fail(f"timestamp {s[i:match.end()]} is not within years {_MIN_YEAR}..{_MAX_YEAR}")
        when = _EPOCH + timedelta(seconds=seconds)
        for name, field in zip(("year", "month", "day", "hour", "minute"), when.timetuple()):
            self.chains[name] = [[field, -1, 0]]
        self.second = [[when.second * _USEC, -1, 0]]
        self.utc = True
        return match.end()

    def parse_time(self, i: int) -> int:
        s = self.s
        if i == len(s):
            self.chains["hour"], self.chains["minute"] = [[0, -1, 0]], [[0, -1, 0]]
            self.second = [[0, -1, 0]]
            return i
        self.chains["hour"], i = self.parse_chain(i, False)
        if not s.startswith(":", i):
            raise self.fail(f"expected ':' at {self.rest(i)}")
        self.chains["minute"], i = self.parse_chain(i + 1, False)
        if i == len(s):
            self.second = [[0, -1, 0]]
            return i
        if s[i] != ":":
            raise self.fail(f"unexpected {self.rest(i)} in time")
        self.second, i = self.parse_chain(i + 1, True)
        return i

    def spec(self, zone_name: str | None, dst: int) -> _Spec:
        year = self.chains["year"]
        if year is not None:
            for r in year:  # two-digit years: 0..69 are 2000..2069, 70..99 are 1970..1999
                r[:2] = [v + 2000 if 0 <= v < 70 else v + 1900 if 70 <= v < 100 else v for v in r[:2]]
        chains = {name: _normalize_chain(chain) for name, chain in self.chains.items()}
        spec = _Spec(
            weekdays=self.weekdays if 0 < self.weekdays < 127 else 0,
            second=_normalize_chain(self.second),
            end_of_month=self.end_of_month and chains["day"] is not None,
            utc=self.utc,
            zone_name=zone_name,
            dst=dst,
            **chains,
        )
        problem = (
            _chain_problem(spec.year, "year", _MIN_YEAR, _MAX_YEAR)
            or _chain_problem(spec.month, "month", 1, 12)
            or _chain_problem(spec.day, "day", 1, 31, eom=spec.end_of_month)
            or _chain_problem(spec.hour, "hour", 0, 23)
            or _chain_problem(spec.minute, "minute", 0, 59)
            or _chain_problem(spec.second, "second", 0, 60 * _USEC - 1, usec=True)
        )
        if problem:
            raise self.fail(problem)
        return spec


def _split_zone(text: str, local: _Zone) -> tuple[str, bool, str | None, int, _Zone]:
    """Strips a trailing zone: "UTC", the local zone's own abbreviations, or an IANA name."""
    if _lower(text).endswith(" utc"):
        return text[:-4], True, None, -1, _UTC
    for dst, name in enumerate(local.names):
        suffix = text[-len(name) - 1 :]
        if name and len(text) > len(name) and _lower(suffix) == " " + _lower(name):
            return text[: -len(name) - 1], False, None, dst, local
    head, space, last = text.rpartition(" ")
    zone = _named_zone(last) if space else None
    if zone is not None:
        return head, False, last, -1, zone
    return text, False, None, -1, local


def parse_calendar(expr: str) -> CalendarEvent:
    """Parses a systemd calendar event expression; raises CalendarError where systemd would."""
    local = _local_zone()
    text, utc, zone_name, dst, zone = _split_zone(expr, local)
    parser = _Parser(expr, text)
    if not text:
        raise parser.fail("empty expression")
    shorthand = _SHORTHANDS.get(_lower(text))
    if shorthand:
        parser.s = shorthand
    parser.utc = utc
    try:
        parser.parse()
    except CalendarError:
        last = text.rpartition(" ")[2]
        if " " in text and "/" in last and any(c.isalpha() for c in last):
            raise parser.fail(f"unknown time zone {last!r}") from None
        raise
    spec = parser.spec(zone_name, dst)
    if spec.utc:
        zone = _UTC
    return CalendarEvent(expr, _spec_to_string(spec, local), spec, zone)


# ------------------------------------------------------------------------------------- search


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

    def __init__(self, spec: _Spec, clock: _Clock):
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
        start = self.clock.localtime(usec // _USEC)
        self.fields, self.isdst, self.usec = list(start.fields), start.isdst, usec % _USEC
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
            return final.t * _USEC + self.usec

    def _one_pass(self) -> bool | None:
        """True: all components match; False: moved on, try again; None: never."""
        for level, chain in enumerate(self.chains):
            current = self.fields[level] * _USEC + self.usec if level == _SECOND else self.fields[level]
            found = current if chain is None else self._earliest(level, chain, current)
            if found is not None and found != current:
                if level == _SECOND:
                    self.fields[level], self.usec = divmod(found, _USEC)
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

    def _earliest(self, level: int, chain: _Chain, value: int) -> int | None:
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
        if self.fields[_YEAR] > _MAX_YEAR:
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


def _to_usec(moment: datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return (moment - _EPOCH) // timedelta(microseconds=1)


class CalendarEvent:
    """A parsed calendar expression.

    original: the text as given; normalized: systemd's normalized form; tz: the zone the
    event is evaluated in (and the tzinfo of the datetimes it returns)."""

    def __init__(self, original: str, normalized: str, spec: _Spec, zone: _Zone):
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

    def _iter_usec(self, base: datetime, n: int) -> list[int]:
        elapses: list[int] = []
        usec = _to_usec(base)
        while len(elapses) < n:
            usec = self._next_usec(usec)
            if usec is None:
                break
            elapses.append(usec)
        return elapses

    def _as_datetime(self, usec: int) -> datetime:
        return (_EPOCH + timedelta(microseconds=usec)).astimezone(self.tz)

    def next_after(self, base: datetime) -> datetime | None:
        """The first elapse strictly after base (naive = UTC); None if there is none."""
        elapses = self.iter_after(base, 1)
        return elapses[0] if elapses else None

    def iter_after(self, base: datetime, n: int) -> list[datetime]:
        """Up to n consecutive elapses strictly after base."""
        return [self._as_datetime(usec) for usec in self._iter_usec(base, n)]


# ------------------------------------------------------------------------------------ rendering


def _format_timestamp(usec: int, tz: tzinfo) -> str:
    d = datetime.fromtimestamp(usec // _USEC, tz)
    return f"{_DAY_NAMES[d.weekday()]} {d:%Y-%m-%d %H:%M:%S} {d.tzname()}"


def _format_relative(usec: int, now_usec: int) -> str:
    """Roughly systemd's format_timestamp_relative()."""
    delta, suffix = (usec - now_usec, "left") if usec > now_usec else (now_usec - usec, "ago")
    s = delta // _USEC
    year, month, day, hour, minute = 31557600, 2629800, 86400, 3600, 60
    if s >= year:
        text = f"{s // year} years {s % year // month} months"
    elif s >= month:
        text = f"{s // month} months {s % month // day} days"
    elif s >= 7 * day:
        text = f"{s // (7 * day)} weeks {s % (7 * day) // day} days"
    elif s >= 2 * day:
        text = f"{s // day} days"
    elif s >= 25 * hour:
        text = f"1 day {(s - day) // hour}h"
    elif s >= 6 * hour:
        text = f"{s // hour}h"
    elif s >= hour:
        text = f"{s // hour}h {s % hour // minute}min"
    elif s >= 5 * minute:
        text = f"{s // minute}min"
    elif s >= minute:
        text = f"{s // minute}min {s % minute}s"
    elif s:
        text = f"{s}s"
    elif delta >= 1000:
        text = f"{delta // 1000}ms"
    elif delta:
        text = f"{delta}us"
    else:
        return "now"
    return f"{text} {suffix}"


def render_analyze(event: CalendarEvent, base: datetime, n: int, now: datetime | None = None) -> str:
    """The report of `systemd-analyze calendar --iterations=n` (without trailing newline).

    Times are shown in the local zone, as systemd-analyze does, whatever the event's zone."""
    local = _local_zone()
    now_usec = _to_usec(now or datetime.now(timezone.utc))
    rows = [] if event.normalized == event.original else [("Original form", event.original)]
    rows.append(("Normalized form", event.normalized))
    elapses = event._iter_usec(base, n)
    if n > 0 and not elapses:
        rows.append(("Next elapse", "never"))
    for number, usec in enumerate(elapses, 1):
        label = "Next elapse" if number == 1 else f"Iter. #{number}"
        rows.append((label, _format_timestamp(usec, local.tz)))
        if not local.utc_like:
            rows.append(("(in UTC)", _format_timestamp(usec, timezone.utc)))
        rows.append(("From now", _format_relative(usec, now_usec)))
    names = max(len(field) for field, _ in rows) + 1
    values = max(len(value) for _, value in rows)
    # systemd's table pads narrower cells and then trims trailing white space (an original form
    # "Mon " loses its space), but prints the widest cell of the column as it is.
    return "\n".join(
        f"{field + ':':>{names}} {value if len(value) == values else value.rstrip()}"
        for field, value in rows
    )


def render_json(event: CalendarEvent, base: datetime, n: int) -> dict:
    """{"normalized": ..., "next": [ISO 8601 timestamps with offset]}; "next" is [] for never."""
    return {"normalized": event.normalized, "next": [d.isoformat() for d in event.iter_after(base, n)]}
