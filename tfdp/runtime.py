"""Who am I in the job, and where do I compute: `init`, `rank`, `size`, `local_rank`, `is_chief`.

`init` initialises Horovod and pins this worker's device, following Horovod's recipe: one
GPU per process, chosen by `local_rank`, with memory growth; the replica then runs on
``/gpu:0`` (the only GPU the process sees). ``TFDP_DEVICES=cpu`` keeps CPUs. Call it (or
build a strategy, which calls it) before any TensorFlow op: visible devices cannot change
once TensorFlow has started using them.

Example:
    >>> import tfdp
    >>> tfdp.init()
    >>> tfdp.rank(), tfdp.size(), tfdp.replica_device()
    (0, 1, '/cpu:0')
"""

import os

from tfdp._compat.horovod import horovod

DEVICES_ENV = "TFDP_DEVICES"
_DEVICE_SETTINGS = ("auto", "cpu", "gpu")
_replica_device = None


def choose_device(gpu_count, local_rank, local_size, setting="auto"):
    """Return (physical GPU index to make visible, or None; the replica's device name).

    Example:
        >>> choose_device(4, local_rank=2, local_size=4)
        (2, '/gpu:0')
        >>> choose_device(0, local_rank=0, local_size=2)
        (None, '/cpu:0')
    """
    if setting not in _DEVICE_SETTINGS:
        raise ValueError(f"{DEVICES_ENV} must be one of {_DEVICE_SETTINGS}. Received: {DEVICES_ENV}={setting!r}")
    if setting == "cpu" or (setting == "auto" and gpu_count == 0):
        return None, "/cpu:0"
    if gpu_count == 0:
        raise ValueError(f"{DEVICES_ENV}=gpu, but TensorFlow sees no GPU on this host. Install a GPU build of "
                         "TensorFlow with its CUDA libraries, or set TFDP_DEVICES=cpu.")
    if local_rank >= gpu_count:
        raise ValueError(f"This host runs {local_size} workers but has {gpu_count} GPUs: local rank {local_rank} has "
                         f"none. Start at most {gpu_count} workers per host (horovodrun -H host:{gpu_count}), or set "
                         "TFDP_DEVICES=cpu.")
    return local_rank, "/gpu:0"


def _pin_devices(hvd):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    index, device = choose_device(len(gpus), hvd.local_rank(), hvd.local_size(),
                                  os.environ.get(DEVICES_ENV, "auto"))
    if index is not None:
        try:
            tf.config.experimental.set_memory_growth(gpus[index], True)
            tf.config.set_visible_devices(gpus[index], "GPU")
        except RuntimeError as err:  # TensorFlow already set up its devices
            raise RuntimeError(f"tfdp could not pin GPU {index} for local rank {hvd.local_rank()}: {err}. Call "
                               "tfdp.init() (or build the strategy) before any TensorFlow op.") from err
    return device


def init():
    """Initialise Horovod and pin this worker's device (idempotent). Without horovodrun: a job of one."""
    global _replica_device
    hvd = horovod()
    if _replica_device is None:
        _replica_device = _pin_devices(hvd)
    return _replica_device


def replica_device():
    """The device this worker's replica runs on: ``/gpu:0`` (its pinned GPU) or ``/cpu:0``."""
    return init()


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
