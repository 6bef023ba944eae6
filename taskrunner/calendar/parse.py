"""The grammar: systemd's calendar_spec_from_string(), turning an expression into a Spec."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

from .fields import (DAY_NAMES, EPOCH, MAX_YEAR, MIN_YEAR, USEC, CalendarError, Chain, Range, Spec,
                     lower)
from .render import spec_to_string
from .search import CalendarEvent
from .zones import UTC, Zone, local_zone, named_zone

_INT_MAX = 2**31 - 1
_MAX_LIST = 241  # systemd refuses longer comma lists
_MAX_TIMESTAMP = (datetime(MAX_YEAR + 1, 1, 1, tzinfo=timezone.utc) - EPOCH).days * 86400 - 1

_WEEKDAY_WORDS = tuple(
    (word, nr)
    for nr, (full, short) in enumerate(
        zip(("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"), DAY_NAMES)
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


def _normalize_chain(ranges: list[list[int]] | None) -> Chain | None:
    if ranges is None:
        return None
    result = set()
    for start, stop, repeat in ranges:
        if stop > start and repeat > 0:
            stop -= (stop - start) % repeat  # "1..10/4" is "1..9/4"
        if (stop > start and repeat > 0 and start + repeat > stop) or start == stop:
            stop, repeat = -1, 0  # "5..5" and "1..5/10" are just "5" and "1"
        result.add(Range(start, stop, repeat))
    return tuple(sorted(result))


def _show(value: int, usec: bool) -> str:
    if not usec:
        return str(value)
    whole, fraction = divmod(value, USEC)
    return f"{whole}.{fraction:06d}".rstrip("0") if fraction else str(whole)


def _chain_problem(
    chain: Chain | None, what: str, low: int, high: int, usec: bool = False, eom: bool = False
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
            if start_of_date == 0 and lower(word) in _SHORTHANDS:
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
                if lower(s[i : i + len(word)]) == lower(word):
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
                    backwards = f"{DAY_NAMES[range_from]}..{DAY_NAMES[nr]}"
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
            value *= USEC
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
            return ([[0, -1, USEC]] if usec else None), i + 1
        ranges: list[list[int]] = []
        while True:
            if len(ranges) == _MAX_LIST:
                raise self.fail(f"more than {_MAX_LIST} values in a list")
            start, i = self.parse_number(i, usec)
            stop, repeat = -1, 0
            if self.s.startswith("..", i):
                stop, i = self.parse_number(i + 2, usec)
                repeat = USEC if usec else 1
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
            raise self.fail(f"timestamp {s[i:match.end()]} is not within years {MIN_YEAR}..{MAX_YEAR}")
        when = EPOCH + timedelta(seconds=seconds)
        for name, field in zip(("year", "month", "day", "hour", "minute"), when.timetuple()):
            self.chains[name] = [[field, -1, 0]]
        self.second = [[when.second * USEC, -1, 0]]
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

    def spec(self, zone_name: str | None, dst: int) -> Spec:
        year = self.chains["year"]
        if year is not None:
            for r in year:  # two-digit years: 0..69 are 2000..2069, 70..99 are 1970..1999
                r[:2] = [v + 2000 if 0 <= v < 70 else v + 1900 if 70 <= v < 100 else v for v in r[:2]]
        chains = {name: _normalize_chain(chain) for name, chain in self.chains.items()}
        spec = Spec(
            weekdays=self.weekdays if 0 < self.weekdays < 127 else 0,
            second=_normalize_chain(self.second),
            end_of_month=self.end_of_month and chains["day"] is not None,
            utc=self.utc,
            zone_name=zone_name,
            dst=dst,
            **chains,
        )
        problem = (
            _chain_problem(spec.year, "year", MIN_YEAR, MAX_YEAR)
            or _chain_problem(spec.month, "month", 1, 12)
            or _chain_problem(spec.day, "day", 1, 31, eom=spec.end_of_month)
            or _chain_problem(spec.hour, "hour", 0, 23)
            or _chain_problem(spec.minute, "minute", 0, 59)
            or _chain_problem(spec.second, "second", 0, 60 * USEC - 1, usec=True)
        )
        if problem:
            raise self.fail(problem)
        return spec


def _split_zone(text: str, local: Zone) -> tuple[str, bool, str | None, int, Zone]:
    """Strips a trailing zone: "UTC", the local zone's own abbreviations, or an IANA name."""
    if lower(text).endswith(" utc"):
        return text[:-4], True, None, -1, UTC
    for dst, name in enumerate(local.names):
        suffix = text[-len(name) - 1 :]
        if name and len(text) > len(name) and lower(suffix) == " " + lower(name):
            return text[: -len(name) - 1], False, None, dst, local
    head, space, last = text.rpartition(" ")
    zone = named_zone(last) if space else None
    if zone is not None:
        return head, False, last, -1, zone
    return text, False, None, -1, local


def parse_calendar(expr: str) -> CalendarEvent:
    """Parses a systemd calendar event expression; raises CalendarError where systemd would."""
    local = local_zone()
    text, utc, zone_name, dst, zone = _split_zone(expr, local)
    parser = _Parser(expr, text)
    if not text:
        raise parser.fail("empty expression")
    shorthand = _SHORTHANDS.get(lower(text))
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
        zone = UTC
    return CalendarEvent(expr, spec_to_string(spec, local), spec, zone)
