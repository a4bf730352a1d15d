"""Import and initialise Horovod once, with an error that says how to install it."""

import os

_INSTALL_HINT = (
    "tfdp needs Horovod 0.28.1 built with TensorFlow support. "
    "Install it with `bash tools/setup_env.sh` from the tfdp repository "
    "(it builds Horovod from source against the installed TensorFlow)."
)

# A rank that stalls (dead peer, mismatched collectives) must end the job, not hang it.
# Horovod only warns about stalls unless a shutdown time is set.
_DEFAULTS = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "20",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
}

_hvd = None


def horovod():
    """Return the initialised `horovod.tensorflow` module.

    Raises:
        ImportError: Horovod is missing or was built without TensorFlow.
    """
    global _hvd
    if _hvd is not None:
        return _hvd
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        raise ImportError(f"{_INSTALL_HINT} (import failed: {err})") from err
    try:
        hvd.init()
    except Exception as err:  # Horovod raises plain exceptions for build problems.
        raise ImportError(f"{_INSTALL_HINT} (horovod.init failed: {err})") from err
    if hasattr(hvd, "tensorflow_built") and not hvd.tensorflow_built():
        raise ImportError(f"{_INSTALL_HINT} (this Horovod was built without TensorFlow)")
    _hvd = hvd
    return hvd
