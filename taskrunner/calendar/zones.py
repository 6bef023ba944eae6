"""Time zones as glibc sees them: the local zone, IANA zone suffixes, and tzname[]."""

from __future__ import annotations

import functools
import io
import os
import re
import struct
from dataclasses import dataclass
from datetime import timezone, tzinfo
from zoneinfo import ZoneInfo

_ZONEINFO_DIR = "/usr/share/zoneinfo"
_ZONE_NAME = re.compile(r"[A-Za-z0-9_+-]+(?:/[A-Za-z0-9_+-]+)*\Z")


@dataclass(frozen=True)
class Zone:
    tz: tzinfo
    names: tuple[str, str]  # glibc's tzname[0] (standard) and tzname[1] (daylight saving)
    utc_like: bool  # glibc's "timezone == 0 && daylight == 0": systemd then omits "(in UTC)"


UTC = Zone(timezone.utc, ("UTC", "UTC"), True)


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
def _load_zone(path: str, key: str | None) -> Zone | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(b"TZif"):
            return None
        tz = ZoneInfo.from_file(io.BytesIO(data), key=key)
        names, utc_like = _tzif_rules(data)
    except (OSError, ValueError, struct.error, IndexError):
        return None
    return Zone(tz, names, utc_like)


def local_zone() -> Zone:
    """The zone glibc would use: $TZ, else /etc/localtime, else UTC.

    POSIX rule strings in $TZ (like "CET-1CEST,M3.5.0,M10.5.0/3") are not supported and
    fall back to UTC."""
    value = os.environ.get("TZ")
    if value == "":
        return UTC
    name = (value or "")[1:] if (value or "").startswith(":") else value
    if not name:
        real = os.path.realpath("/etc/localtime")
        key = os.path.relpath(real, _ZONEINFO_DIR) if real.startswith(_ZONEINFO_DIR + "/") else None
        return _load_zone("/etc/localtime", key) or UTC
    path = name if name.startswith("/") else os.path.join(_ZONEINFO_DIR, name)
    return _load_zone(path, name) or UTC


def named_zone(name: str) -> Zone | None:
    """An IANA zone suffix, accepted under the same rules as systemd's verify_timezone()."""
    if not _ZONE_NAME.match(name):
        return None
    path = os.path.join(_ZONEINFO_DIR, name)
    return _load_zone(path, name) if os.path.isfile(path) else None
