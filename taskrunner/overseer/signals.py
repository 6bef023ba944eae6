"""The self-pipe of a process loop (the overseer's, the maintainer's): its signal handlers
only record the signal, and the loop sleeps on a pipe that the interpreter writes a byte to
on every signal (`signal.set_wakeup_fd`), so a signal ends the sleep at once and no handler
logs, locks or touches the database (gunicorn's arbiter does the same)."""
import contextlib
import os
import select
import signal


class SignalPipe:
    """Installs `handler(signum, frame)` for the signals `names` ("SIGTERM", ...) and wakes
    `sleep` when any of them arrives."""

    def __init__(self, names, handler):
        self.names = tuple(names)
        self.handler = handler
        self.read_fd = self.write_fd = None

    def install(self):
        """In the process that loops: the pipe, then the handlers (a signal that arrives
        between the two still wakes the first sleep)."""
        self.read_fd, self.write_fd = os.pipe()
        for fd in (self.read_fd, self.write_fd):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.write_fd)
        for name in self.names:
            signal.signal(getattr(signal, name), self.handler)

    def sleep(self, timeout):
        """Until a signal arrives or `timeout` seconds pass."""
        if timeout > 0 and select.select([self.read_fd], [], [], timeout)[0]:
            with contextlib.suppress(BlockingIOError):
                while os.read(self.read_fd, 512):
                    pass

    def uninstall_in_child(self):
        """In a child just forked: the default handlers back, no wake-up fd, the pipe
        closed (the child's signals must not wake its parent's loop)."""
        for name in self.names:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for fd in (self.read_fd, self.write_fd):
            if fd is not None:
                os.close(fd)
