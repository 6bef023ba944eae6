"""Output: systemd's normalized form, `systemd-analyze calendar` text, and JSON."""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timezone, tzinfo
from typing import Iterator

from .fields import DAY_NAMES, USEC, Chain, Spec
from .search import CalendarEvent, to_usec
from .zones import Zone, local_zone


# ------------------------------------------------------------------------------ normalized form


def _format_chain(chain: Chain | None, width: int, usec=False) -> str:
    # systemd 252 shows the whole seconds list as "*" when any item is "every second"
    if chain is None or (usec and (0, -1, USEC) in chain):
        return "*"
    unit = USEC if usec else 1
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
            parts.append(f"{DAY_NAMES[first]}..{DAY_NAMES[last]}")
        else:
            parts.extend(DAY_NAMES[first : last + 1])
    return ",".join(parts)


def spec_to_string(spec: Spec, local: Zone) -> str:
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


# ------------------------------------------------------------------------------------ rendering


def _format_timestamp(usec: int, tz: tzinfo) -> str:
    d = datetime.fromtimestamp(usec // USEC, tz)
    return f"{DAY_NAMES[d.weekday()]} {d:%Y-%m-%d %H:%M:%S} {d.tzname()}"


def _count(number: int, unit: str) -> str:
    return f"{number} {unit}" if number == 1 else f"{number} {unit}s"


def _format_relative(usec: int, now_usec: int) -> str:
    """Roughly systemd's format_timestamp_relative()."""
    delta, suffix = (usec - now_usec, "left") if usec > now_usec else (now_usec - usec, "ago")
    s = delta // USEC
    year, month, day, hour, minute = 31557600, 2629800, 86400, 3600, 60
    if s >= year:
        text = f"{_count(s // year, 'year')} {_count(s % year // month, 'month')}"
    elif s >= month:
        text = f"{_count(s // month, 'month')} {_count(s % month // day, 'day')}"
    elif s >= 7 * day:
        text = f"{_count(s // (7 * day), 'week')} {_count(s % (7 * day) // day, 'day')}"
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


# Rows whose widths set the columns before the first line is printed; later rows stream.
_MEASURED = 1000


def iter_analyze(event: CalendarEvent, base: datetime, n: int,
                 now: datetime | None = None) -> Iterator[str]:
    """The lines of `systemd-analyze calendar --iterations=n`, each as soon as it is computed.

    Times are shown in the local zone, as systemd-analyze does, whatever the event's zone.
    The columns are as wide as systemd makes them for the first _MEASURED elapses; beyond
    those, the label column is made wide enough for "Iter. #n"."""
    local = local_zone()
    now_usec = to_usec(now or datetime.now(timezone.utc))
    rows = [] if event.normalized == event.original else [("Original form", event.original)]
    rows.append(("Normalized form", event.normalized))

    def elapse_rows(number: int, usec: int) -> list[tuple[str, str]]:
        label = "Next elapse" if number == 1 else f"Iter. #{number}"
        result = [(label, _format_timestamp(usec, local.tz))]
        if not local.utc_like:
            result.append(("(in UTC)", _format_timestamp(usec, timezone.utc)))
        result.append(("From now", _format_relative(usec, now_usec)))
        return result

    elapses = enumerate(event.elapses_usec(base), 1) if n > 0 else iter(())
    measured = list(itertools.islice(elapses, min(n, _MEASURED)))
    if n > 0 and not measured:
        rows.append(("Next elapse", "never"))
    for number, usec in measured:
        rows.extend(elapse_rows(number, usec))
    names = max(len(field) for field, _ in rows) + 1
    if n > len(measured) == _MEASURED:
        names = max(names, len(f"Iter. #{n}:"))
    values = max(len(value) for _, value in rows)
    # systemd's table pads narrower cells and then trims trailing white space (an original form
    # "Mon " loses its space), but prints the widest cell of the column as it is.
    streamed = (row for number, usec in itertools.islice(elapses, n - len(measured))
                for row in elapse_rows(number, usec))
    for field, value in itertools.chain(rows, streamed):
        yield f"{field + ':':>{names}} {value if len(value) == values else value.rstrip()}"


def render_analyze(event: CalendarEvent, base: datetime, n: int, now: datetime | None = None) -> str:
    """The report of `systemd-analyze calendar --iterations=n` (without trailing newline)."""
    return "\n".join(iter_analyze(event, base, n, now))


def iter_json(event: CalendarEvent, base: datetime, n: int) -> Iterator[str]:
    """render_json()'s text, json.dumps() style, in pieces as the elapses are computed."""
    head = json.dumps({"normalized": event.normalized, "next": []})
    yield head[:-2]
    for number, usec in enumerate(itertools.islice(event.elapses_usec(base), max(n, 0))):
        yield (", " if number else "") + json.dumps(event.as_datetime(usec).isoformat())
    yield "]}"


def render_json(event: CalendarEvent, base: datetime, n: int) -> dict:
    """{"normalized": ..., "next": [ISO 8601 timestamps with offset]}; "next" is [] for never."""
    return {"normalized": event.normalized, "next": [d.isoformat() for d in event.iter_after(base, n)]}
