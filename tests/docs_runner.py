"""Runs one page's code examples in order, in the current directory (tests/test_docs.py
starts it in a fresh one): ``python docs_runner.py PLAN.json``.

A block titled with a file name (```` ```python title="tasks.py" ````) is written as that
file; Python blocks run in one namespace, as a reader pasting them one after the other
would; shell blocks run in ``bash -euo pipefail``; TOML blocks are loaded as a taskrunner
configuration (their ``[[periodic]]`` tables checked as the overseer checks them); INI and
YAML blocks are parsed. A failure names the page and the line of the block."""
import configparser
import json
import os
import subprocess
import sys
import traceback


def check_toml(code):
    from taskrunner.config import Config, tomllib   # tomli before Python 3.11
    from taskrunner.periodic.definitions import definition
    config = Config.from_dict(tomllib.loads(code), source="<example>")
    for spec in config.periodic:
        definition(config, spec, "[[periodic]] %s" % spec.get("name"), import_handler=False)


def check_yaml(code):
    import yaml     # the test extra's PyYAML; test_docs checks the metric names in it too
    yaml.safe_load(code)


def run(block, namespace):
    lang, code, title = block["lang"], block["code"], block["title"]
    if title:
        os.makedirs(os.path.dirname(title) or ".", exist_ok=True)
        with open(title, "w") as fh:
            fh.write(code)
        if lang == "toml" and title.endswith(".toml"):
            check_toml(code)
    elif lang == "python":
        exec(compile(code, block["where"], "exec"), namespace)
    elif lang in ("sh", "bash"):
        subprocess.run(["bash", "-euo", "pipefail", "-c", code], check=True, timeout=120)
    elif lang == "toml":
        check_toml(code)
    elif lang == "ini":
        configparser.ConfigParser(strict=True).read_string(code)
    elif lang == "yaml":
        check_yaml(code)


def main(plan_path):
    with open(plan_path) as fh:
        plan = json.load(fh)
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "__main__"}
    for block in plan:
        try:
            run(block, namespace)
        except BaseException:
            sys.stderr.write("example at %s failed:\n%s\n%s" % (
                block["where"], block["code"], traceback.format_exc()))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
