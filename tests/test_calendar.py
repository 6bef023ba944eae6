"""taskrunner.calendar against the real thing: `systemd-analyze calendar` (systemd 252).

The differential tests feed several hundred generated expressions (valid and invalid) to both,
in three zones and around DST changes, and require identical acceptance, normalized forms and
elapse lines.  Property tests check the search on its own terms: every elapse is later than the
previous one and matches the expression field by field.
"""

from __future__ import annotations

import calendar
import os
import random
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrunner.calendar import CalendarError, parse_calendar, render_analyze, render_json

from conftest import examples

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
ITERATIONS = 5
NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)  # "From now" lines are not compared anyway


def at(text: str) -> int:
    """Seconds since the epoch of an ISO time with offset."""
    return int(datetime.fromisoformat(text).timestamp())


# Zone and base time pairs.  Besides an ordinary base, every zone with DST gets one base shortly
# before the clocks go forward and one shortly before they go back.
CONFIGS = [
    ("UTC", at("2023-11-14T22:13:20+00:00")),
    ("UTC", at("2024-02-28T12:00:00+00:00")),
    ("Europe/Berlin", at("2023-11-14T22:13:20+00:00")),
    ("Europe/Berlin", at("2024-03-31T01:20:00+01:00")),
    ("Europe/Berlin", at("2024-10-27T01:45:00+02:00")),
    ("America/New_York", at("2023-07-04T12:00:00-04:00")),
    ("America/New_York", at("2024-03-10T01:10:00-05:00")),
    ("America/New_York", at("2024-11-03T00:50:00-04:00")),
]

# ------------------------------------------------------------------------------ the expressions

HANDWRITTEN_VALID = """
minutely|hourly|daily|weekly|monthly|yearly|annually|anually|quarterly|semiannually|semi-annually
biannually|bi-annually|HOURLY|Daily|wEeKlY|Semi-Annually|daily UTC|daily utc|weekly Pacific/Auckland
monthly Europe/Berlin|quarterly America/New_York|hourly Asia/Kolkata|minutely Etc/GMT+5
Sat,Thu,Mon..Wed,Sat..Sun|Mon,Sun 12-*-* 2,1:23|Wed *-1|Wed..Wed,Wed *-1|Wed, 17:48
Wed..Sat,Tue 12-10-15 1:2:3|*-*-7 0:0:0|10-15|monday *-12-* 17:00|Mon,Fri *-*-3,1,2 *:30:45
12,14,13,12:20,10,30|12..14:10,20,30|mon,fri *-1/2-1,3 *:30:45|03-05 08:05:40|08:05:40|05:40
Sat,Sun 12-05 08:05:40|Sat,Sun 08:05:40|2003-03-05 05:40|05:40:23.4200004/3.1700005
2003-02..04-05|2003-03-05 05:40 UTC|2003-03-05|03-05|*:2/3|*-02~03|Mon *-05~07/1
Mon-Wed|Mon-Wed,Fri 9:00|Monday..Friday 07:30|MON,tue,Wednesday 12:00|Sun,|fri, 18:00|Mon
Mon..Fri *-*-* 07:30:00 Europe/Berlin|Sat..Sun 10:00 America/New_York
*-02-29|*-02-29 12:00|Mon *-02-29|2024-02-29 00:00|*-*-31|*-*-31 23:59:59|*-01,03,05-31
*-02-30|*-02-31|*-04-31|2023-02-29|*-*-30,31|*-*-01,31|*-*-29..31
*-*~01|*-*~1|*-*~28|*-02~01|*-*~03..07|*-*~07/1|*-*~07/2|Fri *-*~07/1 18:00|*-*~02,05
70-01-01|69-01-01|00-06-15|99-12-31|23-*-*|0-1-1|70..75-01-01|24..26-*-01
2000..2010/3-1-1|2023..2199/50-01-01|2199-12-31 23:59:59|2199-12-31 23:59:59 UTC|1970-01-01
*:0/15|*:0/10:0/30|*:*:0/20|*:*:*|*:*:0/1|*:*:0.5|*:*:0.25/0.25|*:*:0.5/0.5|*:*:59.999999
*:*:0.5..3|*:*:0..0.5/1|*:*:1.5..10.5/2.5|*:*:00.1234567|*:*:0.9999995|12:00:30.000001
0..30/5:00|5..5:00|1..5/10:00|1..10/4:00|1..3,2..4:00|0,12:0..59/20|*:*:0..59/7
2024-*-* 02:30|*-*-* 02:30|*-*-* 02:00|*-*-* 02:59:59|*-*-* 01:30|*-*-* 03:00|*:30|*:00|hourly
*-*-* 02,03:30|*-*-* 01..03:15|Sun *-*-* 02:30|Sun *-03,10,11-* 01..03:00/20|*-*-* 00/7:00
*-*-* 02:30 Europe/Berlin|*-*-* 02:30 America/New_York|*-*-* 01:30 America/New_York
*:30 America/New_York|*:0/20 Europe/Berlin|Sun 01..03:00 Europe/Berlin|*-03,10~07/1 02:30
daily CET|daily CEST|*-*-* 02:30 CET|*-*-* 02:30 CEST|12:00 EST|12:00 EDT|*-*-* 01:30 EDT
*-*-* 01:30 EST|hourly CET|hourly EDT
@0|@1|@1700000000|@1700000123|@1711846800|@7258118399|@ 86400|@+5|@-0|Mon @5|@1700000000 UTC
@1700000000 Europe/Berlin
2023-11-15 07:30:00.5|2024-01-01..07 00:00|*-12-24..26 18:00|Mon..Fri *-*-1..7 09:00
Mon *-*-1..7|Tue *-11-2..8|*-*-* 12:00:00 Etc/UTC|*-*-* 12:00 posix/Europe/Berlin
*-*-* 12:00 GMT+0|*-*-* 12:00 EST5EDT|2024-03-31 02:30|2024-03-10 02:30|2024-10-27 02:30
2024-11-03 01:30|2024-03-31 02:30 Europe/Berlin|2024-11-03 01:30 America/New_York
tuesday-Sun,tuesday,SATURDAY 2045/5-*-07 |Mon  12:00|2023-01-01 |Mon |Mon,  08:00|*-*-*   12:00
*:*:00/1,00..06/2|*:*:0/1,0.5|*:*:0..59/1,0.5|*:*:0..10,0/1|*:*:00,00/1|1/1,0:00|*:0/1,5:00
*-*~10,1..02|*-*~1..2,1..3|*-*~4..5,10|*-*~1,4..5,2|*:*:0/7|*:0/7:0/13|*-01/5,04-26 21:44
*-01/5,04-26 21:44 America/New_York|*-*-* 00/7:00 Europe/Berlin|*-*~1,2,3,4,5,6
"""

HANDWRITTEN_INVALID = """
bogus|Mond|Mon..|Mon-|Wed..Mon|Mon..Tue..Wed|Mon.Tue|Mon,,Tue|Mon:12|Monday.. 12:00|Mo 12:00
*|*-*-*-*|2023-01-01-01|*-*-32|*-13-01|*-0-01|*-*-0|24:00|*:60|*:*:60|12:00:00:00|1:2:3:4
*:*:-1|-1:00|*-*-* 12:00 ,|12:00 |  daily| daily|daily |dailyy|daily Mon|weekly UTC UTC
*-02~30|*-*~29|*-*~0|*-*~1/1|*-*~07..03|*-02~03-01|02~03-01-01|*~01|1969-01-01|2200-01-01
100-01-01|1970..1969-01-01|69..71-01-01|*-*-* 00/24:00|*:0/60|*:*:0/60|*:*:30/30|0/0:00
*:00/0|5..4:00|*:*:0..0.5|*:*:1.|*:*:.5|*:*:1...3|1..:00|..1:00|1,:00|,1:00|1,,2:00
12|12 00:00|*,5:00|*/5|*:*/5|*:0/5/5|1..5..7:00|@|@-5|@1.5|@1 12:00|@7258118400|@99999999999
@18446744073709551616|@abc|12:00 Europe/Nowhere|12:00 europe/berlin|12:00 Europe//Berlin
12:00 Europe/Berlin/|12:00 ./UTC|12:00 zone.tab|12:00 Europe|Europe/Berlin|UTC| UTC|CET
*-*~10,1..02,23|*-*~1,2,3,4,5,6,7,8,9,10|12:00 CEST CEST|2023-01-01T12:00|2023/01/01|12h00
noon|now|today|+5min|0 12 * * *|*-*-* 12:00Z
*-*-* 12:00+01:00|Mon Tue|Mon,Tue,|2023-02-30-|2023--01|2023-01-|-01-01|:00|12:|12::00
*:*:00.|*:*:0x10|0x10:00|1e3:00|١٢:00|１２:００|99999999999:00|*:*:2147483648|*-*-* 1:2:3.4.5
"""


def split_cases(text: str) -> list[str]:
    return [case for line in text.strip("\n").split("\n") for case in line.split("|")]


_DAYS_SHORT = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
_DAYS_LONG = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _random_case(rng: random.Random, word: str) -> str:
    mixed = "".join(rng.choice((c.lower(), c.upper())) for c in word)
    return rng.choice([word, word.lower(), word.upper(), mixed])


def _weekdays(rng: random.Random) -> str:
    def name(day: int) -> str:
        return _random_case(rng, rng.choice((_DAYS_SHORT, _DAYS_LONG))[day])

    parts = []
    for _ in range(rng.randint(1, 3)):
        first = rng.randrange(7)
        form = rng.random()
        if form < 0.4:
            parts.append(name(first))
        else:
            last = rng.randrange(first, 7)
            parts.append(name(first) + (".." if form < 0.8 else "-") + name(last))
    return ",".join(parts) + ("," if rng.random() < 0.15 else "")


def _component(rng: random.Random, low: int, high: int, width: int = 2, fraction: bool = False) -> str:
    """One date or time field: *, a value, a list, a range, a/r or a..b/r."""

    def value(lo: int = low, hi: int = high) -> str:
        v = rng.randint(lo, hi)
        text = f"{v:0{width}d}" if rng.random() < 0.7 else str(v)
        if fraction and rng.random() < 0.3:
            text += "." + str(rng.randint(0, 999999)).rjust(rng.randint(1, 7), "0")[: rng.randint(1, 7)]
        return text

    def item() -> str:
        form = rng.random()
        if form < 0.45:
            return value()
        start = rng.randint(low, high - 1)
        if form < 0.7:
            return f"{value(start, start)}..{value(start + 1, high)}"
        step = rng.randint(1, max(1, (high - start) // 2))
        if form < 0.85:
            return f"{value(start, start)}/{step}"
        return f"{value(start, start)}..{value(start + 1, high)}/{step}"

    if rng.random() < 0.3:
        return "*"
    return ",".join(item() for _ in range(rng.choice((1, 1, 1, 2, 3))))


def _date(rng: random.Random) -> str:
    month, day = _component(rng, 1, 12), _component(rng, 1, 31)
    if rng.random() < 0.15:
        day = _component(rng, 1, 28)
        year = "*" if rng.random() < 0.5 else _component(rng, 2020, 2040, 4)
        return f"{year}-{month}~{day}"
    if rng.random() < 0.3:
        return f"{month}-{day}"
    year = _component(rng, 2023, 2060, 4) if rng.random() < 0.8 else _component(rng, 20, 40)
    return f"{year}-{month}-{day}"


def _time(rng: random.Random) -> str:
    text = f"{_component(rng, 0, 23)}:{_component(rng, 0, 59)}"
    return text + (f":{_component(rng, 0, 59, fraction=True)}" if rng.random() < 0.6 else "")


_ZONE_SUFFIXES = ["", "", "", ""] + [
    " UTC", " Europe/Berlin", " America/New_York", " Asia/Kolkata", " Pacific/Auckland"
]


def generated_valid(count: int, seed: int = 252) -> list[str]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        parts = []
        if rng.random() < 0.3:
            parts.append(_weekdays(rng))
        if rng.random() < 0.7:
            parts.append(_date(rng))
        if rng.random() < 0.8 or not parts:
            parts.append(_time(rng))
        cases.append(" ".join(parts) + rng.choice(_ZONE_SUFFIXES))
    return cases


def generated_invalid(valid: list[str], count: int, seed: int = 7) -> list[str]:
    """Small corruptions of valid expressions; systemd decides whether they still parse."""
    rng = random.Random(seed)
    damage = [
        lambda s: s + rng.choice(("x", ":", "-", ",", "..", "/", "~", "/0")),
        lambda s: s.replace(":", "::", 1),
        lambda s: s.replace("-", "~", 2),
        lambda s: s.replace("*", "**", 1),
        lambda s: s.replace("0", "9", 1),
        lambda s: s.replace("..", "...", 1),
        lambda s: s.replace("/", "/0", 1),
        lambda s: s.replace(",", ",,", 1),
        lambda s: rng.choice(("Moon ", "Mo ", "Mon.. ", "Sun..Mon ")) + s,
        lambda s: s[: rng.randrange(1, max(2, len(s)))],
    ]
    return [rng.choice(damage)(rng.choice(valid)) for _ in range(count)]


def long_lists() -> list[str]:
    return [
        "*-*-" + ",".join(["1"] * 241),
        "*-*-" + ",".join(["1"] * 242),
        "*:" + ",".join(str(i % 60) for i in range(241)),
        "*:" + ",".join(str(i % 60) for i in range(242)),
    ]


VALID_CASES = split_cases(HANDWRITTEN_VALID) + generated_valid(300)
INVALID_CASES = split_cases(HANDWRITTEN_INVALID) + generated_invalid(VALID_CASES, 120) + long_lists()
ALL_CASES = list(dict.fromkeys(VALID_CASES + INVALID_CASES))

# -------------------------------------------------------------------------- running both sides


@dataclass
class Answer:
    lines: list[str]  # without "From now" lines; empty when systemd refused
    parse_failed: bool
    elapse_failed: bool


def _blocks(stdout: str) -> list[list[str]]:
    """systemd-analyze prints one block per expression, an empty line between blocks, and
    nothing at all for an expression it refuses."""
    lines = stdout.split("\n")
    if stdout.endswith("\n"):
        lines.pop()
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line:
            blocks[-1].append(line)
        else:
            blocks.append([])
    return blocks


def _comparable(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.lstrip().startswith("From now:")]


def systemd_answers(exprs: list[str], tz: str, base: int, n: int = ITERATIONS) -> list[Answer]:
    env = dict(os.environ, TZ=tz, LC_ALL="C", SYSTEMD_COLORS="0", SYSTEMD_PAGER="")
    command = [SYSTEMD_ANALYZE, "calendar", f"--base-time=@{base}", f"--iterations={n}", "--", *exprs]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    blocks = _blocks(result.stdout) if result.stdout else [[]]
    assert len(blocks) == len(exprs), (len(blocks), len(exprs), result.stderr[-2000:])
    answers = []
    for expr, block in zip(exprs, blocks):
        parse_failed = f"Failed to parse calendar specification '{expr}'" in result.stderr
        elapse_failed = f"Failed to determine next elapse for '{expr}'" in result.stderr
        assert bool(block) != (parse_failed or elapse_failed), (expr, block, result.stderr[-2000:])
        answers.append(Answer(_comparable(block), parse_failed, elapse_failed))
    return answers


@contextmanager
def local_zone(tz: str):
    saved = os.environ.get("TZ")
    os.environ["TZ"] = tz
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = saved


def our_answer(expr: str, tz: str, base: int, n: int = ITERATIONS) -> Answer | str:
    """Our report for expr, or the CalendarError message."""
    with local_zone(tz):
        try:
            event = parse_calendar(expr)
        except CalendarError as error:
            return str(error)
        report = render_analyze(event, datetime.fromtimestamp(base, timezone.utc), n, now=NOW)
    return Answer(_comparable(report.split("\n")), False, False)


def mismatch(expr: str, tz: str, base: int, theirs: Answer, ours: Answer | str) -> str | None:
    where = f"{expr!r} (TZ={tz}, base=@{base})"
    if theirs.parse_failed:
        return None if isinstance(ours, str) else f"{where}: systemd refuses it, we accept it"
    if isinstance(ours, str):
        return f"{where}: systemd accepts it, we refuse it: {ours}"
    if theirs.elapse_failed:
        # systemd 252 gave up ("Infinite loop in calendar calculation") at some iteration and then
        # prints nothing; we must agree on the iterations before it, then say never.
        found = [line for line in ours.lines if "Iter. #" in line or "Next elapse:" in line]
        theirs = _last_success(expr, tz, base, len(found) - found[-1].endswith("never"))
        if theirs is None:
            ok = ours.lines[-1].endswith("Next elapse: never")
            return None if ok else f"{where}: systemd gives up at once, we: {ours.lines}"
    if theirs.lines != ours.lines:
        pairs = zip(theirs.lines, ours.lines)
        diff = "\n".join(f"   systemd: {a}\n   ours:    {b}" for a, b in pairs if a != b)
        counts = f"(systemd {len(theirs.lines)} lines, ours {len(ours.lines)})"
        return f"{where}: output differs\n{diff}\n   {counts}"
    return None


def _last_success(expr: str, tz: str, base: int, n: int) -> Answer | None:
    """systemd's report with the most iterations (at most n) that it completes."""
    for k in range(min(n, ITERATIONS - 1), 0, -1):
        (answer,) = systemd_answers([expr], tz, base, k)
        if not answer.elapse_failed:
            return answer
    return None


@lru_cache(maxsize=None)
def all_systemd_answers() -> dict[tuple[str, int], list[Answer]]:
    """Every configuration at once, in parallel; one systemd-analyze run per configuration."""
    with ThreadPoolExecutor(max_workers=len(CONFIGS)) as pool:
        futures = {config: pool.submit(systemd_answers, ALL_CASES, *config) for config in CONFIGS}
    return {config: future.result() for config, future in futures.items()}


# ---------------------------------------------------------------------------- differential tests


def test_corpus_is_broad():
    assert len(VALID_CASES) >= 400 and len(INVALID_CASES) >= 200
    assert len(ALL_CASES) * len(CONFIGS) >= 4000


@needs_systemd
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tz,base", CONFIGS, ids=[f"{tz}@{base}" for tz, base in CONFIGS])
def test_same_as_systemd_analyze(tz, base):
    answers = all_systemd_answers()[(tz, base)]
    problems = [
        problem
        for expr, theirs in zip(ALL_CASES, answers)
        if (problem := mismatch(expr, tz, base, theirs, our_answer(expr, tz, base)))
    ]
    assert not problems, f"{len(problems)} of {len(ALL_CASES)} differ:\n" + "\n".join(problems[:30])


@needs_systemd
def test_corpus_exercises_both_outcomes():
    answers = all_systemd_answers()[CONFIGS[0]]
    accepted = sum(not a.parse_failed for a in answers)
    assert accepted >= 350 and len(answers) - accepted >= 150
    assert sum(any("Iter. #5" in line for line in a.lines) for a in answers) >= 250


@needs_systemd
def test_systemd_gives_up_where_we_say_never():
    """The known difference: systemd 252 stops after 1000 passes with an error."""
    cases = [
        ("UTC", 1700000000, "*-02,04,06,09,11-31"),  # takes too long to rule out
        ("Europe/Berlin", at("2024-03-30T22:00:00+01:00"), "*-*-* 00/7:00"),  # goes round in circles
    ]
    for tz, base, expr in cases:
        (theirs,) = systemd_answers([expr], tz, base)
        assert theirs.elapse_failed
        with local_zone(tz):
            assert parse_calendar(expr).next_after(datetime.fromtimestamp(base, timezone.utc)) is None


# ------------------------------------------------------------------------------ property tests


@dataclass(frozen=True)
class Field:
    """A field as generated: (start, stop or None, repeat) items, in units of `unit`; None is '*'."""

    items: tuple | None
    width: int = 2
    unit: int = 1

    def text(self) -> str:
        if self.items is None:
            return "*"

        def show(v: int, width: int) -> str:
            whole, fraction = divmod(v, self.unit)
            return f"{whole:0{width}d}" + (f".{fraction:06d}" if fraction else "")

        parts = []
        for start, stop, repeat in self.items:
            text = show(start, self.width) + (f"..{show(stop, self.width)}" if stop is not None else "")
            parts.append(text + (f"/{show(repeat, 1)}" if repeat else ""))
        return ",".join(parts)

    def matches(self, value: int, high: int) -> bool:
        if self.items is None:
            return value % self.unit == 0
        for start, stop, repeat in self.items:
            step = repeat or (self.unit if stop is not None else 0)
            end = high if stop is None else stop
            if value == start or (step and start <= value <= end and (value - start) % step == 0):
                return True
        return False


    def matches_from_month_end(self, day: int, last: int) -> bool:
        """'~': an item counts from its start-th last day forwards; a range a..b covers the b-th
        to the a-th last day, with b first trimmed to a whole number of steps from a."""
        for start, stop, repeat in self.items:
            if stop is not None and repeat:
                stop -= (stop - start) % repeat
                if start + repeat > stop:
                    stop, repeat = None, 0
            first = last + 1 - (start if stop is None else stop)
            end = last if stop is None else last + 1 - start
            step = repeat or (1 if stop is not None else 0)
            if day == first or (step and first <= day <= end and (day - first) % step == 0):
                return True
        return False


def fields(low: int, high: int, width: int = 2, unit: int = 1, fraction: bool = False):
    item = st.tuples(
        st.integers(low, high - 1),
        st.integers(1, high - low),
        st.integers(0, 3),
        st.sampled_from((0, 0, 250_000, 500_000) if fraction else (0,)),
    ).map(lambda t: _item(*t, high=high, unit=unit))
    some = st.lists(item, min_size=1, max_size=3).map(lambda items: Field(tuple(items), width, unit))
    return st.one_of(st.just(Field(None, width, unit)), some)


def _item(start: int, span: int, form: int, fraction: int, high: int, unit: int) -> tuple:
    """start, start..stop, start/step or start..stop/step, always valid for systemd."""
    stop = min(high, start + span)
    step = max(1, (stop - start) // 3)
    if form == 0 or (form == 2 and start + step > high):
        return (start * unit + fraction, None, 0)
    if form == 1:
        return (start * unit + fraction, stop * unit + fraction, 0)
    if form == 2:
        return (start * unit + fraction, None, step * unit)
    return (start * unit + fraction, stop * unit + fraction, step * unit)


def _month_end_item(start: int, span: int, form: int) -> tuple:
    """Like _item for '~' days: steps go forward, so start/step needs start > step."""
    stop = min(22, start + span)
    step = max(1, (stop - start) // 3)
    if form == 0 or (form == 2 and start - step < 1):
        return (start, None, 0)
    if form == 1:
        return (start, stop, 0)
    if form == 2:
        return (start, None, step)
    return (start, stop, step)


# At most three '~' items up to 22: systemd allows 28 for the first, 25 for the second, 22 ...
month_end_days = st.lists(
    st.tuples(st.integers(1, 21), st.integers(1, 21), st.integers(0, 3)).map(
        lambda t: _month_end_item(*t)
    ),
    min_size=1,
    max_size=3,
).map(lambda items: Field(tuple(items)))


@dataclass(frozen=True)
class Expression:
    weekdays: frozenset[int] | None
    year: Field
    month: Field
    day: Field
    from_month_end: bool
    hour: Field
    minute: Field
    second: Field
    zone: str

    def text(self) -> str:
        days = "" if self.weekdays is None else ",".join(_DAYS_SHORT[d] for d in sorted(self.weekdays))
        days += " " if days else ""
        before_day = "~" if self.from_month_end else "-"
        return (
            f"{days}{self.year.text()}-{self.month.text()}{before_day}{self.day.text()} "
            f"{self.hour.text()}:{self.minute.text()}:{self.second.text()}{self.zone}"
        )

    def matches(self, moment: datetime) -> bool:
        last = calendar.monthrange(moment.year, moment.month)[1]
        if self.from_month_end:
            day_ok = self.day.matches_from_month_end(moment.day, last)
        else:
            day_ok = self.day.matches(moment.day, 31)
        return (
            (self.weekdays is None or moment.weekday() in self.weekdays)
            and self.year.matches(moment.year, 2199)
            and self.month.matches(moment.month, 12)
            and day_ok
            and self.hour.matches(moment.hour, 23)
            and self.minute.matches(moment.minute, 59)
            and self.second.matches(moment.second * 1_000_000 + moment.microsecond, 59_999_999)
        )


ZONES = ["", " UTC", " Europe/Berlin", " America/New_York"]


@st.composite
def expressions(draw) -> Expression:
    from_month_end = draw(st.booleans())
    return Expression(
        weekdays=draw(st.one_of(st.none(), st.frozensets(st.integers(0, 6), min_size=1, max_size=6))),
        year=draw(st.one_of(st.just(Field(None, 4)), fields(2024, 2030, 4))),
        month=draw(fields(1, 12)),
        day=draw(month_end_days if from_month_end else fields(1, 31)),
        from_month_end=from_month_end,
        hour=draw(fields(0, 23)),
        minute=draw(fields(0, 59)),
        second=draw(fields(0, 59, unit=1_000_000, fraction=True)),
        zone=draw(st.sampled_from(ZONES)),
    )


bases = st.datetimes(datetime(2023, 1, 1), datetime(2026, 12, 31), timezones=st.just(timezone.utc))
local_zones = st.sampled_from(["UTC", "Europe/Berlin", "America/New_York"])
base_seconds = st.integers(at("2023-01-01T00:00:00+00:00"), at("2026-12-31T00:00:00+00:00"))
PROPERTY_SETTINGS = settings(
    max_examples=examples(300), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.timeout(120)
@PROPERTY_SETTINGS
@given(expressions(), bases, local_zones)
def test_elapses_are_later_and_match(expr, base, tz):
    with local_zone(tz):
        event = parse_calendar(expr.text())
        elapses = event.iter_after(base, 4)
    suffix = expr.zone.strip()
    zone = timezone.utc if suffix == "UTC" else ZoneInfo(suffix or tz)
    previous = base.timestamp()
    for moment in elapses:
        # timestamps: Python compares datetimes sharing a tzinfo by wall clock, ignoring fold
        assert moment.timestamp() > previous
        assert moment.tzinfo is not None and moment.utcoffset() == moment.astimezone(zone).utcoffset()
        assert expr.matches(moment.astimezone(zone)), (expr.text(), moment)
        previous = moment.timestamp()
    assert event.next_after(base) == (elapses[0] if elapses else None)


@needs_systemd
@pytest.mark.timeout(120)
@settings(max_examples=examples(60), deadline=None, database=None)
@given(expressions(), base_seconds, local_zones)
def test_hypothesis_against_systemd(expr, base, tz):
    text = expr.text()
    (theirs,) = systemd_answers([text], tz, base)
    problem = mismatch(text, tz, base, theirs, our_answer(text, tz, base))
    assert problem is None, problem


# ------------------------------------------------------------------------------------ the API


def test_api_shapes():
    with local_zone("Europe/Berlin"):
        event = parse_calendar("Mon..Fri 07:30")
        assert (event.original, event.normalized) == ("Mon..Fri 07:30", "Mon..Fri *-*-* 07:30:00")
        naive = datetime(2023, 11, 14, 22, 13, 20)
        first = event.next_after(naive)
        assert first == datetime(2023, 11, 15, 7, 30, tzinfo=ZoneInfo("Europe/Berlin"))
        assert first.tzinfo.key == "Europe/Berlin"
        assert event.iter_after(naive.replace(tzinfo=timezone.utc), 3)[0] == first
        assert render_json(event, naive, 2) == {
            "normalized": "Mon..Fri *-*-* 07:30:00",
            "next": ["2023-11-15T07:30:00+01:00", "2023-11-16T07:30:00+01:00"],
        }
        report = render_analyze(event, naive, 2, now=datetime(2023, 11, 15, tzinfo=timezone.utc))
        assert report.split("\n")[:5] == [
            "  Original form: Mon..Fri 07:30",
            "Normalized form: Mon..Fri *-*-* 07:30:00",
            "    Next elapse: Wed 2023-11-15 07:30:00 CET",
            "       (in UTC): Wed 2023-11-15 06:30:00 UTC",
            "       From now: 6h left",
        ]
    utc = parse_calendar("2024-02-29 09:00 UTC")
    assert utc.next_after(datetime(2024, 1, 1)).tzinfo is timezone.utc
    assert render_json(utc, datetime(2024, 1, 1), 3) == {
        "normalized": "2024-02-29 09:00:00 UTC",
        "next": ["2024-02-29T09:00:00+00:00"],
    }
    assert render_json(utc, datetime(2025, 1, 1), 3)["next"] == []
    assert render_analyze(utc, datetime(2025, 1, 1), 3).split("\n")[-1] == "    Next elapse: never"


def test_fractional_elapses_keep_microseconds():
    event = parse_calendar("*:*:0.25/0.5 UTC")
    assert event.iter_after(datetime(2024, 1, 1), 3) == [
        datetime(2024, 1, 1, 0, 0, 0, 250000, tzinfo=timezone.utc),
        datetime(2024, 1, 1, 0, 0, 0, 750000, tzinfo=timezone.utc),
        datetime(2024, 1, 1, 0, 0, 1, 250000, tzinfo=timezone.utc),
    ]


def test_dst_semantics():
    with local_zone("Europe/Berlin"):
        event = parse_calendar("*-*-* 02:30")
        # there is no 02:30 on 2024-03-31: skipped, not moved
        berlin = ZoneInfo("Europe/Berlin")
        assert event.next_after(datetime(2024, 3, 30, 12)) == datetime(2024, 4, 1, 2, 30, tzinfo=berlin)
        # 02:30 happens twice on 2024-10-27: the summer-time one fires, then the next day's
        twice = event.iter_after(datetime(2024, 10, 26, 12), 2)
        assert [t.astimezone(timezone.utc).hour for t in twice] == [0, 1]
        assert twice[0].fold == 0 and twice[1].day == 28
        # systemd quirk: a step that runs past :59 into the next hour keeps its remainder
        lost = parse_calendar("*:*:0/7").iter_after(datetime(2024, 1, 10, 1, 59, 50), 2)
        assert [t.strftime("%H:%M:%S") for t in lost] == ["02:59:56", "03:00:07"]


@pytest.mark.parametrize(
    "expr,reason",
    [
        ("bogus", "unknown weekday or keyword 'bogus'"),
        ("Mond", "unknown weekday 'Mond'"),
        ("Wed..Mon", "weekday range Wed..Mon goes backwards"),
        ("*-*-32", "day 32 is out of range 1..31"),
        ("*:*:61", "second 61 is out of range 0..59.999999"),
        ("1969-01-01", "year 1969 is out of range 1970..2199"),
        ("*:0/0", "repetition must not be zero"),
        ("", "empty expression"),
        ("daily Mon", "'daily' cannot be combined with anything but a time zone"),
        ("12:00 Europe/Nowhere", "unknown time zone 'Europe/Nowhere'"),
        ("@7258118400", "is not within years 1970..2199"),
    ],
)
def test_errors_say_what_is_wrong(expr, reason):
    with pytest.raises(CalendarError) as caught:
        parse_calendar(expr)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert message.startswith(f"invalid calendar expression {expr!r}: ") and reason in message
    assert "\n" not in message


# How fast these are: bench/calendar_speed.py.
@pytest.mark.timeout(60)     # a search that never ends hangs; its speed is not judged here
def test_an_expression_that_never_elapses_says_so():
    for expr in ("*-02-30", "*-04-31 UTC", "*-02,04,06,09,11-31 Europe/Berlin", "2023-*-* 12:00"):
        assert parse_calendar(expr).next_after(datetime(2024, 1, 1)) is None


@pytest.mark.timeout(60)
def test_thousands_of_elapses_across_a_clock_change_are_evenly_spaced():
    event = parse_calendar("*:*:0/5 Europe/Berlin")
    elapses = event.iter_after(datetime(2024, 3, 31), 3000)  # across the switch to summer time
    assert len(elapses) == 3000
    assert all(b.timestamp() - a.timestamp() == 5 for a, b in zip(elapses, elapses[1:]))
