"""Rank 0 speaks for the job: the stdout of other ranks is silenced, reversibly.

One process-wide `ChiefStdout` wraps the real ``sys.stdout`` the first time a strategy is
built on more than one worker. It passes writes through on rank 0 and drops them on the
other ranks; every strategy built sets it from its own rank, so after an elastic reset the
new rank 0 speaks. Errors still reach stderr on every rank. ``TFDP_VERBOSE_WORKERS=1``
keeps every rank's stdout; `set_worker_stdout` changes it at run time, and
`restore_stdout` puts the original stream back.

Example:
    >>> tfdp.set_worker_stdout(True)   # let every rank print from now on
"""

import os
import sys

VERBOSE_WORKERS_ENV = "TFDP_VERBOSE_WORKERS"


class ChiefStdout:
    """A stdout that writes on the chief and drops text elsewhere; all else is the real stream's."""

    def __init__(self, stream):
        self.stream = stream
        self.rank = 0
        self.workers_may_print = os.environ.get(VERBOSE_WORKERS_ENV) == "1"

    @property
    def silenced(self):
        return self.rank != 0 and not self.workers_may_print

    def write(self, text):
        if self.silenced:
            return len(text)
        return self.stream.write(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        return self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _installed():
    return sys.stdout if isinstance(sys.stdout, ChiefStdout) else None


def follow_rank(rank, size):
    """Silence stdout unless this is rank 0 of several (or workers may print); called per strategy."""
    wrapper = _installed()
    if wrapper is None:
        if size < 2:
            return
        wrapper = ChiefStdout(sys.stdout)
        sys.stdout = wrapper
    wrapper.rank = rank


def set_worker_stdout(enabled):
    """Let workers other than rank 0 print to stdout (True) or silence them (False, the default)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be True or False. Received: enabled={enabled!r}")
    wrapper = _installed()
    if wrapper is None:
        wrapper = ChiefStdout(sys.stdout)
        sys.stdout = wrapper
    wrapper.workers_may_print = enabled


def worker_stdout():
    """True when workers other than rank 0 may print to stdout."""
    wrapper = _installed()
    return wrapper is None or wrapper.workers_may_print


def restore_stdout():
    """Put back the stdout tfdp wrapped (every rank prints again)."""
    wrapper = _installed()
    if wrapper is not None:
        sys.stdout = wrapper.stream
