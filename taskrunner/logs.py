"""How taskrunner's processes log on stderr: ``[log] format = "text"`` (one line per record)
or ``"json"`` (one JSON object per line, for log shippers). A run's records carry its
run id, task id, handler, status and duration as fields (``extra=run_fields(...)``)."""
import json
import logging
import sys
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
# Fields of a run's records, copied into each JSON object when present.
RUN_FIELDS = ("run_id", "task_id", "handler", "status", "duration", "error_code")


def run_fields(claimed, status, duration=None, error_code=None):
    """`extra=` of a log call about a claimed run."""
    return {"run_id": claimed.run_id, "task_id": claimed.task_id, "handler": claimed.handler,
            "status": status, "duration": None if duration is None else round(duration, 6),
            "error_code": error_code}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601 UTC), level, logger, pid, message, the run
    fields it has, and the traceback of an exception logged with it."""

    def format(self, record):
        entry = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                     timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "pid": record.process,
                 "message": record.getMessage()}
        for name in RUN_FIELDS:
            if getattr(record, name, None) is not None:
                entry[name] = getattr(record, name)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class Redacting(logging.Formatter):
    """Another formatter's lines passed through `redact` (the CLI masks the database URL's
    secrets with it, in every line, tracebacks included)."""

    def __init__(self, inner, redact):
        super().__init__()
        self.inner, self.redact = inner, redact

    def format(self, record):
        return self.redact(self.inner.format(record))


def setup_logging(level, fmt="text", redact=None):
    # The formats name no source file, function or thread: skip collecting them (the
    # logging HOWTO's "Optimization"), which a runner would otherwise do for every run.
    logging._srcfile = None
    logging.logThreads = logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(Redacting(formatter, redact) if redact else formatter)
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    # Creating the schema on first use is routine: peewee's line per migration only at debug.
    logging.getLogger("peewee.migrations").setLevel(
        logging.DEBUG if level == "debug" else logging.WARNING)
