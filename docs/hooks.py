"""MkDocs hooks: a page's ``<!-- generated: NAME -->`` line is replaced by the reference
that docs/gen_reference.py builds from the code, so a reference cannot drift from it.

The generator runs in a process of its own: this checkout's package, not whichever copy of
it the MkDocs process may have imported already (mkdocstrings may inspect one)."""
import os
import re
import subprocess
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.MULTILINE)


def generated(name):
    return subprocess.run([sys.executable, os.path.join(DOCS, "gen_reference.py"), name],
                          cwd=os.path.dirname(DOCS), check=True, capture_output=True,
                          text=True).stdout


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: generated(m.group(1)), markdown)
