"""What the ``taskrunner`` commands share: the types of their arguments (ISO times, JSON,
seconds, task ids), one-line errors, tables and JSON on stdout, and the queue a command
opens (its schema brought up to date first)."""
import argparse
import json
import math
import re
import sys
from datetime import datetime, timezone

from ..errors import InputError
from ..masking import mask_url, masked


# Characters that end a line for a terminal or for str.splitlines().
LINE_BREAKING = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text):
    """`text` with control characters escaped: an error quotes what the user typed, and a
    newline in it must not make a second line (or move the cursor)."""
    return LINE_BREAKING.sub(lambda m: "\\x%02x" % ord(m.group()) if ord(m.group()) < 256
                              else "\\u%04x" % ord(m.group()), str(text))


def iso_time(text):
    try:
        # "Z" is not understood by fromisoformat before Python 3.11.
        when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        if when.tzinfo is None:
            when = when.astimezone()  # naive means local time
        return when.astimezone(timezone.utc)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError("invalid ISO 8601 time %r" % text) from None


def json_arg(text):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("invalid JSON: %s" % exc) from None
    except RecursionError:
        raise argparse.ArgumentTypeError("invalid JSON: nested too deeply") from None


def span_arg(text):
    """A positive duration written as the config writes one: seconds (``90``) or a span
    (``5min``, ``1h 30min``)."""
    from ..timespan import parse_timespan
    try:
        value = float(text)         # seconds, 1e3 included
    except ValueError:
        try:
            value = parse_timespan(text)
        except ValueError:
            value = -1
    if not (0 < value < math.inf):  # also refuses nan
        raise argparse.ArgumentTypeError("expected a positive number of seconds or a time "
                                         "span like '5min', got %r" % text)
    return value


def task_id_arg(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("invalid int value: %r" % text) from None
    if not 0 < value < 2 ** 63:  # what an id column holds on every database
        raise argparse.ArgumentTypeError("no task can have id %r" % text)
    return value


def task_id_list(text):
    """ID,ID,...: task ids, at least one."""
    ids = [task_id_arg(part.strip()) for part in text.split(",") if part.strip()]
    if not ids:
        raise argparse.ArgumentTypeError("expected task ids like 12,13")
    return ids


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got %r" % text)
    return value


TABLE_WIDTH = 120      # columns of a table unless --wide (a terminal, a 120-column log)


def print_table(headers, rows, wide=False, zone=False):
    """Columns padded to their widest cell; within TABLE_WIDTH unless `wide`: the widest
    columns are cut (ending "..."), never below their header or 10 characters. `zone`: a
    last line saying the zone of the times (`when`), once for the whole table."""
    rows = [[one_line("" if v is None else v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if not wide:
        widths = _fitted(widths, [max(len(h), 10) for h in headers])
    for row in [headers] + rows:
        print("  ".join(_cut(v, w).ljust(w) for v, w in zip(row, widths)).rstrip())
    if zone:
        print(zone_note())


def _fitted(widths, floors):
    widths = list(widths)
    while sum(widths) + 2 * (len(widths) - 1) > TABLE_WIDTH:
        widest = max(range(len(widths)), key=lambda i: widths[i] - floors[i])
        if widths[widest] <= floors[widest]:
            break
        widths[widest] -= 1
    return widths


def _cut(text, width):
    return text if len(text) <= width else text[:width - 3] + "..."


def zone_note():
    """The zone of every time a table shows: "times are local: CET (UTC+1)"."""
    local = datetime.now().astimezone()
    minutes = int(local.utcoffset().total_seconds()) // 60
    if not minutes:
        return "times are local: %s" % ("UTC" if local.tzname() in ("UTC", "GMT") else
                                        "%s (UTC)" % local.tzname())
    hours, rest = divmod(abs(minutes), 60)
    offset = "%s%d%s" % ("-" if minutes < 0 else "+", hours, ":%02d" % rest if rest else "")
    return "times are local: %s (UTC%s)" % (local.tzname(), offset)


def add_wide(parser):
    parser.add_argument("--wide", action="store_true",
                        help="every column in full, however wide (default: %d columns)"
                        % TABLE_WIDTH)


def open_queue(args):
    from ..api import TaskQueue
    return TaskQueue(args.loaded_config, migrate=True)


def masked_url(queue):
    return mask_url(queue.config.database.url)


def print_password_hash():
    """``--hash-password``: the hash of the password on the first line of standard input."""
    from ..passwords import hash_password
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise InputError("--hash-password reads the password from standard input; got none")
    print(hash_password(password))


def print_json(value):
    print(json.dumps(value, indent=2))


def shown(record, config):
    """A task's, run's or periodic task's JSON as the CLI shows it: the secret keys of its
    data, results, checkpoint and steps' results masked (``[task] secret_keys``, masking.py)."""
    words = config.task.secret_keys
    shown_record = {key: masked(value, words) if key in ("data", "results", "checkpoint")
                    else value for key, value in record.items()}
    if shown_record.get("steps"):
        shown_record["steps"] = [dict(step, result=masked(step["result"], words))
                                 for step in shown_record["steps"]]
    return shown_record


def checked_arg(check, text, errors=(InputError,)):
    """``check(text)`` as an argparse type: its refusal (`errors`) is argparse's one-line
    usage error (exit 2) naming what is wrong."""
    try:
        return check(text)
    except errors as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def code_version_arg(text):
    """A code version as written on the command line ([runner] code_version's rules)."""
    from ..config import check_code_version
    return checked_arg(check_code_version, text, (ValueError,))


def queue_name(text):
    from ..config import check_queue_name
    return checked_arg(check_queue_name, text)


def queue_list(text):
    from ..config import parse_queue_list
    return checked_arg(parse_queue_list, text)


def add_max_attempts(parser):
    """``--max-attempts N`` (the clear name) or ``--max-retries N`` (the same count, its older
    name), not both: the runs a task may take in all, the first included (1: no retry)."""
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--max-attempts", type=int, metavar="N",
                      help="runs in all, the first included, that may fail before it is given "
                           "up (1: no retry)")
    runs.add_argument("--max-retries", type=int, metavar="N",
                      help="the same as --max-attempts (runs in all, not retries after the "
                           "first)")
