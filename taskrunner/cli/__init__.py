"""The ``taskrunner`` command: the parser and its commands (`commands`), shared argument
handling (`args`) and the commands grouped by what they act on (`runs`, `periodic`,
`queues`, `calendar`). ``taskrunner.cli:main`` is the console script's entry point."""
from .commands import main

__all__ = ["main"]
