"""Who am I in the job: `init`, `rank`, `size`, `local_rank`, `is_chief`.

Example:
    >>> import tfdp
    >>> tfdp.init()
    >>> tfdp.rank(), tfdp.size()
    (0, 1)
"""

from tfdp._compat.horovod import horovod


def init():
    """Initialise Horovod (idempotent). Without horovodrun this is a job of one worker."""
    horovod()


def rank():
    """Return this worker's rank in ``[0, size())``."""
    return horovod().rank()


def size():
    """Return the number of workers."""
    return horovod().size()


def local_rank():
    """Return this worker's rank among the workers on its host."""
    return horovod().local_rank()


def is_chief():
    """Return True on rank 0, the worker that prints and writes files."""
    return rank() == 0
