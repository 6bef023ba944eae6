"""What the calendar modules share: limits, CalendarError, and the parsed expression (Spec)."""

from __future__ import annotations

import string
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import NamedTuple

USEC = 1_000_000
MIN_YEAR, MAX_YEAR = 1970, 2199
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
# systemd compares names with strcasecmp(), which folds ASCII only.
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def lower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


class CalendarError(ValueError):
    """An expression that systemd would refuse."""


# ----------------------------------------------------------------------------------- the spec


class Range(NamedTuple):
    """start, start+repeat, ... up to stop (-1: no limit); repeat 0 means just start.

    Seconds are kept in microseconds.  With '~' days count back from the end of the month."""

    start: int
    stop: int
    repeat: int


Chain = tuple  # tuple[Range, ...]; None stands for "*"


@dataclass(frozen=True)
class Spec:
    weekdays: int  # bit 0 = Monday; 0 = any day
    year: Chain | None
    month: Chain | None
    day: Chain | None
    hour: Chain | None
    minute: Chain | None
    second: Chain  # microseconds; systemd always has this one
    end_of_month: bool
    utc: bool
    zone_name: str | None
    dst: int  # -1, or 0/1 when the local zone's standard/daylight name was given
