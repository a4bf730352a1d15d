"""Horovod: import and initialise it once, with an error that says how to install it.

Also every use tfdp makes of Horovod's non-public modules (its elastic state and run
loop, its launcher's rendezvous server), each naming the Horovod file it comes from.
"""

import ipaddress
import os
import socket

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


def cross_size(env=None):
    """How many hosts the job spans, as horovodrun tells its workers (1 outside horovodrun)."""
    env = os.environ if env is None else env
    return int(env.get("HOROVOD_CROSS_SIZE", "1") or 1)


def cross_rank(env=None):
    """This host's index among the job's hosts, as horovodrun tells its workers (0 outside horovodrun)."""
    env = os.environ if env is None else env
    return int(env.get("HOROVOD_CROSS_RANK", "0") or 0)


def loopback_host_problem(env=None, resolve=None, hostname=None):
    """What is wrong when a job spanning hosts runs here under a name that resolves to loopback, or None.

    horovodrun's Gloo workers learn the number of hosts from ``HOROVOD_CROSS_SIZE`` and the
    name the launcher reached this host by from ``HOROVOD_HOSTNAME`` (``localhost`` or an
    address there: the launcher does not rely on names, e.g. one machine listed as
    ``localhost``, ``127.0.0.1`` and its own address). Horovod
    0.28.1 builds its Gloo device from the address this host's name resolves to (and
    ``HOROVOD_HOSTNAME``'s); if that is a loopback address, the other hosts are told to
    connect to 127.x and `hvd.init()` fails with "gloo::IoException ... Connection refused".
    Debian maps the host name to 127.0.1.1 by default.
    """
    env = os.environ if env is None else env
    resolve, hostname = resolve or socket.gethostbyname, hostname or socket.gethostname
    if cross_size(env) < 2:
        return None
    named = env.get("HOROVOD_HOSTNAME")
    if named and _is_address_literal(named):
        return None  # the launcher reached this host by address or as localhost, not by its name
    for name in dict.fromkeys(n for n in (hostname(), named) if n):
        try:
            address = resolve(name)
        except OSError:
            continue  # a label the launcher gave (not a network name): not what Gloo connects to
        if ipaddress.ip_address(address).is_loopback:
            return f"this host's name {name!r} resolves to {address}, a loopback address"
    return None


def _is_address_literal(name):
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_host_address(env=None, **lookups):
    """Raise, before Horovod's Gloo set-up fails obscurely, when `loopback_host_problem` finds one."""
    env = os.environ if env is None else env
    problem = loopback_host_problem(env, **lookups)
    if problem:
        raise RuntimeError(
            f"tfdp: rank {env.get('HOROVOD_RANK', '?')}: the job spans {env.get('HOROVOD_CROSS_SIZE')} hosts, but "
            f"{problem}: the other hosts could not reach this worker and Horovod's Gloo would fail inside "
            "hvd.init() with 'Connection refused'. Fix one of: map the name to this host's network address in "
            "/etc/hosts; set HOROVOD_HOSTNAME to a name or address the other hosts reach; or pass "
            "--network-interface IFACE to horovodrun (tfdp run passes it through).")


def horovod():
    """Return the initialised `horovod.tensorflow` module.

    Raises:
        ImportError: Horovod is missing or was built without TensorFlow.
        RuntimeError: a job spanning hosts, run here under a name that resolves to loopback.
    """
    global _hvd
    if _hvd is not None:
        return _hvd
    check_host_address()
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
