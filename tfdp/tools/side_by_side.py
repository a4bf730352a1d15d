"""Start timed phases together in processes that run side by side on one machine.

`tfdp bench` on emulated hosts runs every worker on this machine's CPUs: in the job each
worker computes while the others do. A baseline timed on one process alone has every CPU to
itself and predicts a shorter step than the job can make. The side-by-side baseline runs one
copy of the single-worker job per worker, at once, and each copy waits here at the start of
every timed phase until all have reached it, so every copy is timed while the others work.

Example:
    >>> meet = Rendezvous("/tmp/peers", copies=2)
    >>> meet("training")  # returns once both copies have called it
"""

import os
import time
from pathlib import Path


class Rendezvous:
    """A barrier between `copies` processes through files in `directory` (one per copy and phase)."""

    def __init__(self, directory, copies, timeout=300.0):
        if not isinstance(copies, int) or copies < 1:
            raise ValueError(f"`copies` must be an int >= 1. Received: {copies!r}")
        self.directory = Path(directory)
        self.copies = copies
        self.timeout = timeout

    def __call__(self, phase):
        """Wait until every copy has reached `phase`; a copy missing after `timeout` seconds, or one
        that ended (`abandon`), is an error."""
        if self.copies == 1:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{phase}.{os.getpid()}").touch()
        deadline = time.monotonic() + self.timeout
        while len(list(self.directory.glob(f"{phase}.*"))) < self.copies:
            if (self.directory / ABANDONED).exists():
                raise RuntimeError(f"side-by-side baseline: another copy ended before {phase!r} "
                                   f"(see its output above); this copy stops too.")
            if time.monotonic() > deadline:
                raise TimeoutError(f"side-by-side baseline: {self.copies} copies should reach {phase!r}, "
                                   f"{len(list(self.directory.glob(f'{phase}.*')))} did in {self.timeout:g} s "
                                   f"(in {self.directory}). A copy failed or is stuck: see its output above.")
            time.sleep(0.005)


ABANDONED = "abandoned"


def abandon(directory):
    """Tell the copies meeting in `directory` that one of them ended: they stop waiting."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / ABANDONED).touch()


def alone(phase):
    """The rendezvous of a process that runs alone: nothing to wait for."""


__all__ = ["Rendezvous", "abandon", "alone"]
