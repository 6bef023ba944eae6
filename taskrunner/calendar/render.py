"""Output: systemd's normalized form, `systemd-analyze calendar` text, and JSON."""

from __future__ import annotations

from datetime import datetime, timezone, tzinfo

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


def _format_relative(usec: int, now_usec: int) -> str:
    """Roughly systemd's format_timestamp_relative()."""
    delta, suffix = (usec - now_usec, "left") if usec > now_usec else (now_usec - usec, "ago")
    s = delta // USEC
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
    local = local_zone()
    now_usec = to_usec(now or datetime.now(timezone.utc))
    rows = [] if event.normalized == event.original else [("Original form", event.original)]
    rows.append(("Normalized form", event.normalized))
    elapses = event.iter_usec(base, n)
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
