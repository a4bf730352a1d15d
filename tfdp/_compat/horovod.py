"""Horovod: import and initialise it once, with an error that says how to install it.

Also every use tfdp makes of Horovod's non-public modules (its elastic state and run
loop, its launcher's rendezvous server), each naming the Horovod file it comes from.
"""

import os

INSTALL_HINT = (
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
        raise ImportError(f"{INSTALL_HINT} (import failed: {err})") from err
    try:
        hvd.init()
    except Exception as err:  # Horovod raises plain exceptions for build problems.
        raise ImportError(f"{INSTALL_HINT} (horovod.init failed: {err})") from err
    if hasattr(hvd, "tensorflow_built") and not hvd.tensorflow_built():
        raise ImportError(f"{INSTALL_HINT} (this Horovod was built without TensorFlow)")
    _hvd = hvd
    return hvd


def elastic_state_base():
    """`horovod/common/elastic.py` `State`: the base class of an elastic job's state."""
    from horovod.common.elastic import State

    return State


def elastic_run_fn():
    """`horovod/common/elastic.py` `run_fn(func, reset)` and `horovod/common/exceptions.py`
    `HorovodInternalError`, the error that makes it restore and retry."""
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError

    return run_fn, HorovodInternalError


def start_rendezvous(address, hostnames):
    """Start Horovod's launcher rendezvous on `address` only; return (server, port, slot plan).

    Uses `horovod/runner/http/http_server.py` (`RendezvousHTTPServer`) and
    `horovod/runner/common/util/hosts.py` (`parse_hosts`, `get_host_assignments`), the
    pieces horovodrun itself uses for Gloo jobs.
    """
    import threading

    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer((address, 0), RendezvousHandler, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    slots = sum(int(h.split(":")[1]) for h in hostnames.split(","))
    plan = get_host_assignments(parse_hosts(hostnames), slots)
    server.init(plan)
    return server, server.server_address[1], plan
