"""Periodic task definitions — from the API, the CLI or the config's ``[[periodic]]``
tables — validated into row values before anything is stored: name, handler, timer (with the
zone it was defined in), data, catch-up, jitter, the Nuntium options (timebox, tolerance,
anchor) and Docspell's subject and group. `taskrunner check` and the overseer's sync
validate the config the same way."""
import hashlib
import math
from datetime import timedelta

from ..config import check_queue_name, one_count_of_runs
from ..errors import InputError, check_text
from ..handler import check_handler_path, check_handlers_in_child, encode_data, load_handler
from ..store.models import DEFAULT_QUEUE
from .timers import IntervalTimer, parse_timer, timer_zone
from ..timespan import parse_timespan

CATCH_UP = ("once", "skip")
ANCHORS = ("due", "now")
TIMEBOXES = ("half", "off")
RESERVED_PREFIX = "taskrunner."
BUILTIN_ROTATION = RESERVED_PREFIX + "rotate"


# -- definitions --------------------------------------------------------------------------

# The derived queued_by "periodic:NAME" must fit its 255-character column.
MAX_NAME = 255 - len("periodic:")


def definition(config, spec, where, import_handler=True, builtin=False):
    """Validate one definition (API, CLI or config) into row values; InputError on bad
    input. Without `import_handler` the handler path is checked but not imported. Names
    starting "taskrunner." are taskrunner's own (`builtin`)."""
    known = {"name", "handler", "timer", "data", "priority", "enabled", "catch_up",
             "max_runtime", "min_spacing", "max_retries", "max_attempts", "owner",
             "submitter", "subject", "group", "timebox", "tolerance", "queue", "anchor",
             "resume", "jitter"}
    unknown = set(spec) - known
    if unknown:
        raise InputError("%s: unknown key %s" % (where, ", ".join(sorted(unknown))))
    for key in ("name", "handler", "timer"):
        if not isinstance(spec.get(key), str) or not spec[key].strip():
            raise InputError("%s: %s is required (a string)" % (where, key))
        check_text("%s: %s" % (where, key), spec[key], max_length=None)
    name = spec["name"].strip()
    if len(name) > MAX_NAME:
        raise InputError("%s: name is longer than %d characters" % (where, MAX_NAME))
    if name.startswith(RESERVED_PREFIX) and not builtin:
        raise InputError("%s: names starting %r are reserved for taskrunner's own periodic "
                         "tasks" % (where, RESERVED_PREFIX))
    for key in ("owner", "submitter", "subject", "group"):
        check_text("%s: %s" % (where, key), spec.get(key))
    try:
        if import_handler:
            load_handler(spec["handler"], config.handlers.allow)
        else:
            check_handler_path(spec["handler"], config.handlers.allow)
        zone = timer_zone(spec["timer"])
        timer = parse_timer(spec["timer"], zone)
        data = encode_data(spec.get("data"), config.task.max_data_size)
    except InputError as exc:
        raise type(exc)("%s: %s" % (where, exc)) from None
    catch_up = spec.get("catch_up", "once")
    if catch_up not in CATCH_UP:
        raise InputError("%s: catch_up must be 'once' or 'skip'" % where)
    anchor = spec.get("anchor") or "due"
    if anchor not in ANCHORS:
        raise InputError("%s: anchor must be 'due' (the next due time counts from the last "
                         "one) or 'now' (from when the scheduler ran: Nuntium)" % where)
    if anchor == "now" and (not isinstance(timer, IntervalTimer) or timer.after_finish):
        raise InputError("%s: anchor \"now\" needs an 'every SPAN' timer" % where)
    values = {"name": name, "handler": spec["handler"], "timer": spec["timer"].strip(),
              "data": data,
              "priority": spec.get("priority", 0), "enabled": spec.get("enabled", True),
              "catch_up": catch_up, "owner": spec.get("owner"), "submitter": spec.get("submitter"),
              "max_retries": spec.get("max_retries"), "subject": spec.get("subject"),
              "group_name": spec.get("group"), "timezone": zone,
              "queue": check_queue_name(spec.get("queue") or DEFAULT_QUEUE, "%s: queue" % where),
              "anchor": anchor, "resume": spec.get("resume", False)}
    if isinstance(values["priority"], bool) or not isinstance(values["priority"], int):
        raise InputError("%s: priority must be an integer" % where)
    for key in ("enabled", "resume"):
        if not isinstance(values[key], bool):
            raise InputError("%s: %s must be true or false" % (where, key))
    given = "max_retries" if spec.get("max_attempts") is None else "max_attempts"
    retries = spec.get(given)
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)
                                or retries < 1):
        raise InputError("%s: %s must be an integer of at least 1 (runs in all, the first "
                         "included)" % (where, given))
    values["max_retries"] = one_count_of_runs(spec.get("max_retries"),
                                              spec.get("max_attempts"), "%s: " % where)
    for key in ("max_runtime", "min_spacing"):
        value = spec.get(key)
        if value is not None:
            try:
                value = parse_timespan(value)
            except ValueError as exc:
                raise InputError("%s: %s: %s" % (where, key, exc)) from None
            if key == "max_runtime" and value <= 0:
                raise InputError("%s: max_runtime must be greater than zero" % where)
        values[key] = value
    values.update(_nuntium(spec, timer, values, where))
    values["jitter"] = _jitter(spec.get("jitter"), timer, where)
    return values, timer


def _jitter(value, timer, where):
    """The jitter span in seconds, or None (none: also for "0")."""
    if value is None:
        return None
    try:
        seconds = parse_timespan(value)
    except ValueError as exc:
        raise InputError("%s: jitter: %s" % (where, exc)) from None
    if seconds and timer.after_finish:
        raise InputError("%s: jitter needs a calendar or 'every SPAN' timer (an 'after SPAN' "
                         "timer has no calendar time to spread)" % where)
    return seconds or None


def _nuntium(spec, timer, values, where):
    """Nuntium's timebox and tolerance, tied to an interval timer's span: ``timebox =
    "half"`` is max_runtime = interval / 2, ``tolerance = SPAN`` is min_spacing = interval -
    tolerance (and a due time is submitted even while the previous task is unfinished: the
    check at start decides, as in Nuntium). With a tolerance — Nuntium's mode, where "all
    tasks should be timeboxed to interval / 2" — the timebox is on unless ``timebox = "off"``
    or an absolute max_runtime is given."""
    timebox, tolerance = spec.get("timebox"), spec.get("tolerance")
    derived = {"timebox": timebox, "tolerance": None}
    interval = getattr(timer, "seconds", None)
    if timebox is not None:
        if timebox not in TIMEBOXES:
            raise InputError("%s: timebox must be \"half\" (interval / 2) or \"off\"; an "
                             "absolute limit is max_runtime" % where)
        if values["max_runtime"] is not None:
            raise InputError("%s: give timebox or max_runtime, not both" % where)
    if timebox == "half":
        if interval is None:
            raise InputError("%s: timebox needs an 'every SPAN' or 'after SPAN' timer" % where)
        derived["max_runtime"] = interval / 2
    if tolerance is not None:
        try:
            tolerance = parse_timespan(tolerance)
        except ValueError as exc:
            raise InputError("%s: tolerance: %s" % (where, exc)) from None
        if interval is None or timer.after_finish:
            raise InputError("%s: tolerance needs an 'every SPAN' timer" % where)
        if values["min_spacing"] is not None:
            raise InputError("%s: give tolerance or min_spacing, not both" % where)
        if tolerance >= interval:
            raise InputError("%s: tolerance must be shorter than the interval" % where)
        derived.update(tolerance=tolerance, min_spacing=interval - tolerance)
        if timebox is None and values["max_runtime"] is None:
            derived.update(timebox="half", max_runtime=interval / 2)
    return derived


def first_due(timer, now):
    return timer.next_after(now, anchor=now if isinstance(timer, IntervalTimer) else None)


def jitter_offset(name, nominal, span):
    """The stable offset of the instance of periodic task `name` at calendar time `nominal`
    within a jitter `span` (seconds): whole seconds in [0, span), from a hash of the two, so
    every host and every restart computes the same one (Temporal's schedules hash the
    nominal time the same way)."""
    if span < 1:
        return timedelta(0)
    digest = hashlib.sha256(("%s\0%s" % (name, nominal.isoformat())).encode()).digest()
    return timedelta(seconds=math.floor(int.from_bytes(digest[:8], "big") / 2 ** 64 * span))


def jitter_span(timer, nominal, jitter):
    """The span an instance at `nominal` is spread over: the jitter, cut short so it never
    reaches the timer's next calendar time (instances keep their order, and the instance of
    a calendar time is the one task between it and the next: backfill counts on that)."""
    following = timer.next_after(nominal, anchor=nominal)
    if following is None:
        return jitter
    return min(jitter, (following - nominal).total_seconds())


def due_columns(timer, nominal, name, jitter):
    """The row values for a next instance at calendar time `nominal`: ``nextrun`` is when it
    is due — `nominal` plus its jitter offset — and ``nominal`` keeps the calendar time the
    grid counts on from (NULL without jitter: nextrun is that time)."""
    if nominal is None or not jitter:
        return {"nextrun": nominal, "nominal": None}
    return {"nextrun": nominal + jitter_offset(name, nominal, jitter_span(timer, nominal, jitter)),
            "nominal": nominal}


def check_periodic(config, name, handler, timer, data=None, **options):
    """What add_periodic() checks before it stores anything: InputError for a bad name,
    handler, timer or option. Returns the row values and the parsed timer."""
    return definition(config, dict(name=name, handler=handler, timer=timer, data=data,
                                    **options), "periodic task %r" % (name,))


def validate_definitions(config, import_handlers=True):
    """The config's ``[[periodic]]`` entries and the built-in rotation task, validated:
    {name: (row values, timer)}; InputError naming the file and the entry (or the key) for
    the first bad one. `taskrunner check` and the overseer's sync both go through here."""
    validated = {}
    entries = [dict(d) for d in config.periodic]
    entries.append({"name": BUILTIN_ROTATION, "handler": "taskrunner.handlers.Rotate",
                    "timer": config.rotation.timer, "submitter": "taskrunner"})
    for index, spec in enumerate(entries):
        name = spec.get("name")
        if index == len(entries) - 1:
            where = "%s: [rotation] timer" % config.source
        else:
            where = "%s: [[periodic]] #%d%s" % (config.source, index + 1,
                                                 ' "%s"' % name if isinstance(name, str) else "")
        values, timer = definition(config, spec, where, import_handlers,
                                    builtin=index == len(entries) - 1)
        if values["name"] in validated:
            raise InputError("%s: duplicate name %r" % (where, values["name"]))
        validated[values["name"]] = (values, timer)
    return validated


def check_periodic_handlers(config):
    """The periodic tasks' handlers, imported in a forked child, never in the overseer."""
    paths = {entry.get("handler") for entry in config.periodic}
    message = check_handlers_in_child(sorted(p for p in paths if isinstance(p, str)),
                                      config.handlers.allow)
    if message:
        raise InputError("%s: [[periodic]]: %s" % (config.source, message))
