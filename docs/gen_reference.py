"""The generated references, as Markdown: the CLI from its argument parser, the
configuration from `taskrunner.config`'s schema and descriptions, the metrics from their
definitions, the supervisord recipe from the shipped supervisord.conf. docs/hooks.py puts each where a page says ``<!-- generated: NAME -->``;
tests/test_docs.py checks them against the code too.

Run it to print one: ``python docs/gen_reference.py cli|configuration|metrics|supervisord``.
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout's package, ahead of any other installed copy.
sys.path[:] = [ROOT] + [p for p in sys.path if p != ROOT]


# -- command line ---------------------------------------------------------------------------

def _subcommands(parser):
    for action in parser._actions:   # argparse keeps subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _help_text(parser):
    os.environ["COLUMNS"] = "100"    # argparse wraps to the terminal: a fixed width, one page
    return parser.format_help().rstrip()


def cli_markdown():
    from taskrunner.cli.commands import build_parser
    parser = build_parser()
    out = ["## taskrunner", "", "```text", _help_text(parser), "```", ""]
    for name, sub in _subcommands(parser).items():
        out += ["## %s" % name, ""]
        if sub.description:
            out += [sub.description[0].upper() + sub.description[1:] + ".", ""]
        out += ["```text", _help_text(sub), "```", ""]
        for action_name, action in _subcommands(sub).items():
            out += ["### %s %s" % (name, action_name), "", "```text", _help_text(action),
                    "```", ""]
    return "\n".join(out)


# -- configuration --------------------------------------------------------------------------

def _default(value):
    if isinstance(value, bool):
        return "`%s`" % ("true" if value else "false")
    if isinstance(value, str):
        return '`"%s"`' % value
    if isinstance(value, list):
        return "`[]`" if not value else "`%r`" % value
    if isinstance(value, float) and value.is_integer():
        return "`%d`" % value
    return "`%s`" % value


def _cell(text):
    return text.replace("|", "\\|")


def config_markdown():
    from taskrunner.config import (DESCRIPTIONS, PERIODIC_DESCRIPTIONS, QUEUE_DESCRIPTIONS,
                                   QUEUE_SCHEMA, RATE_LIMITS_DESCRIPTION, SCHEMA)
    out = []
    for section, keys in SCHEMA.items():
        out += ["## [%s]" % section, "", "| key | default | meaning |", "|---|---|---|"]
        for key, (default, _check) in keys.items():
            out.append("| `%s` | %s | %s |" % (key, _default(default),
                                               _cell(DESCRIPTIONS[section, key])))
        out.append("")
    out += ["## [queues.NAME]", "",
            "One table per named queue (see [Queues](../how-to/queues.md)).", "",
            "| key | default | meaning |", "|---|---|---|"]
    for key, (default, _check) in QUEUE_SCHEMA.items():
        out.append("| `%s` | %s | %s |" % (key, _default(default),
                                           _cell(QUEUE_DESCRIPTIONS[key])))
    out += ["", "## [rate_limits]", "", RATE_LIMITS_DESCRIPTION,
            "See [Flow control](../how-to/flow-control.md)."]
    out += ["", "## [[periodic]]", "",
            "One table per periodic task (see [Periodic tasks](../how-to/periodic.md)).", "",
            "| key | meaning |", "|---|---|"]
    for key, text in PERIODIC_DESCRIPTIONS.items():
        out.append("| `%s` | %s |" % (key, _cell(text)))
    return "\n".join(out) + "\n"


# -- metrics --------------------------------------------------------------------------------

_EXPOSED = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def metric_families():
    """(name as exposed, type, help, labels) of every metric, read from the collector's
    definitions on an empty database."""
    from taskrunner import TaskQueue
    from taskrunner.web.metrics import StoreCollector
    with tempfile.TemporaryDirectory() as directory:
        with TaskQueue("sqlite:///%s/metrics.db" % directory, migrate=True) as queue:
            families = list(StoreCollector(queue.store).collect())
    rows = []
    for family in families:
        suffixes = _EXPOSED.get(family.type, ("",))
        name = family.name + suffixes[0] if family.type == "counter" else family.name
        labels = list(family._labelnames)   # prometheus_client keeps them here, empty or not
        rows.append((name, family.type, family.documentation, labels))
    return rows


def metrics_markdown():
    out = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, text, labels in metric_families():
        out.append("| `%s` | %s | %s | %s |" % (
            name, kind, ", ".join("`%s`" % label for label in labels) or "-", _cell(text)))
    return "\n".join(out) + "\n"


def supervisord_markdown():
    """The program sections of the shipped supervisord.conf (tests/test_deploy.py runs that
    file), so the page shows what is tested, never a copy that drifts from it."""
    text = open(os.path.join(ROOT, "supervisord.conf"), encoding="utf-8").read()
    return "```ini\n" + text[text.index("[program:"):].rstrip("\n") + "\n```\n"


GENERATORS = {"cli": cli_markdown, "configuration": config_markdown,
              "metrics": metrics_markdown, "supervisord": supervisord_markdown}

if __name__ == "__main__":
    sys.stdout.write(GENERATORS[sys.argv[1]]())
