"""Time zones as glibc sees them: the local zone, IANA zone suffixes, and tzname[]."""

from __future__ import annotations

import functools
import importlib.resources
import io
import os
import re
import struct
import zoneinfo
from dataclasses import dataclass
from datetime import timezone, tzinfo
from zoneinfo import ZoneInfo

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


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _zone_data(name: str) -> bytes | None:
    """The TZif file of an IANA name where zoneinfo looks for it: each directory of its
    search path (zoneinfo.TZPATH: $PYTHONTZPATH or the system's), then the tzdata package."""
    for directory in zoneinfo.TZPATH:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return _read(path)
    try:
        resource = importlib.resources.files("tzdata.zoneinfo")
        for part in name.split("/"):
            resource = resource.joinpath(part)
        return resource.read_bytes() if resource.is_file() else None
    except (ImportError, OSError, ValueError):
        return None


@functools.lru_cache(maxsize=64)
def _load_zone(path: str | None, key: str | None) -> Zone | None:
    """The zone in the file `path`, or, without a path, the zone named `key`."""
    data = _read(path) if path is not None else _zone_data(key) if key else None
    if data is None:
        return None
    try:
        if not data.startswith(b"TZif"):
            return None
        tz = ZoneInfo.from_file(io.BytesIO(data), key=key)
        names, utc_like = _tzif_rules(data)
    except (ValueError, struct.error, IndexError):
        return None
    return Zone(tz, names, utc_like)


def _key_of(path: str) -> str | None:
    """The IANA name of a zone file inside one of zoneinfo's directories."""
    for directory in zoneinfo.TZPATH:
        if path.startswith(directory.rstrip("/") + "/"):
            return os.path.relpath(path, directory)
    return None


def local_zone() -> Zone:
    """The zone glibc would use: $TZ, else /etc/localtime, else UTC.

    POSIX rule strings in $TZ (like "CET-1CEST,M3.5.0,M10.5.0/3") are not supported and
    fall back to UTC."""
    value = os.environ.get("TZ")
    if value == "":
        return UTC
    name = (value or "")[1:] if (value or "").startswith(":") else value
    if not name:
        return _load_zone("/etc/localtime", _key_of(os.path.realpath("/etc/localtime"))) or UTC
    if name.startswith("/"):
        return _load_zone(name, _key_of(name)) or UTC
    return (_load_zone(None, name) if _ZONE_NAME.match(name) else None) or UTC


def named_zone(name: str) -> Zone | None:
    """An IANA zone suffix, accepted under the same rules as systemd's verify_timezone()."""
    if not _ZONE_NAME.match(name):
        return None
    return _load_zone(None, name)
