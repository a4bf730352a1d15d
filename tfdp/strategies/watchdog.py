"""End a worker whose training batch never finishes: a peer stalled without exiting.

A worker that dies is caught by the launcher (horovodrun ends the job). A worker that
stops submitting collectives but stays alive (a deadlock in user code, a hung data
loader) leaves the others waiting in an all-reduce forever; Horovod 0.28.1's stall
inspector did not end such a job here (tests/test_faults.py). This callback does: when a
training batch runs longer than the timeout, it names the batch on stderr and exits the
process with `EXIT_CODE`, and the launcher then ends the rest of the job.

The first batch of every `fit` (graph tracing) is not timed.

Example:
    >>> strategy = tfdp.MirroredStrategy()   # adds StepWatchdog() to every fit on 2+ workers
    >>> # TFDP_STEP_TIMEOUT_SECONDS=30 horovodrun -np 2 python train.py
"""

import contextlib
import os
import socket
import sys
import threading
import time

import keras

TIMEOUT_ENV = "TFDP_STEP_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_SECONDS = 120.0
EXIT_CODE = 75
_active = set()


def stop_all():
    """Stop every running watchdog (a `fit` that raised never reaches on_train_end)."""
    for dog in list(_active):
        dog.on_train_end()


def timeout_from_env():
    text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_SECONDS))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0. Received: {TIMEOUT_ENV}={text!r}")
    return value


PROBE_PORT = 22  # horovodrun reaches every host of a job over ssh
PROBE_SECONDS = 2.0


def unreachable_hosts(hosts, this_host, port=PROBE_PORT, seconds=PROBE_SECONDS):
    """The hosts among `hosts` (other than `this_host`) that do not accept a TCP connection on `port`."""
    silent = []
    for host in dict.fromkeys(hosts):
        if host == this_host:
            continue
        try:
            socket.create_connection((host, port), timeout=seconds).close()
        except OSError:
            silent.append(host)
    return silent


def lost_hosts(hosts, rank, port=PROBE_PORT):
    """'host h2 (ranks [1]) no longer answers ...' for the peers' hosts that do not answer, else None.

    `hosts` holds every rank's host; one host (or none known) gives None without probing.
    """
    if not hosts or len(set(hosts)) < 2:
        return None
    silent = unreachable_hosts(hosts, hosts[rank], port)
    if not silent:
        return None
    ranks = [r for r, host in enumerate(hosts) if host in silent]
    return (f"host {', '.join(silent)} (ranks {ranks}) no longer answers on port {port}: it failed or "
            "left the network")


class StepWatchdog(keras.callbacks.Callback):
    """Exit this worker with `EXIT_CODE` when a training batch takes longer than `timeout_seconds`.

    `hosts` (each rank's host, for jobs that span hosts) lets it name the hosts that no longer
    answer (on their ssh port) when it fires.
    """

    def __init__(self, rank, timeout_seconds=None, hosts=None):
        super().__init__()
        self.rank = rank
        self.hosts = list(hosts or [])
        self.timeout_seconds = timeout_from_env() if timeout_seconds is None else timeout_seconds
        self._batch = None
        self._started = None
        self._first = True
        self._stop = threading.Event()

    def on_train_begin(self, logs=None):
        self._first = True
        self._stop.clear()
        _active.add(self)
        threading.Thread(target=self._watch, daemon=True, name="tfdp-step-watchdog").start()

    def on_train_batch_begin(self, batch, logs=None):
        if self._first:
            self._first = False
            return
        self._batch, self._started = batch, time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        self._started = None

    @contextlib.contextmanager
    def watching(self, batch):
        """Watch a collective that tfdp runs after `batch`'s callbacks as part of that batch."""
        self._batch, self._started = batch, time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def on_train_end(self, logs=None):
        self._stop.set()
        self._started = None
        _active.discard(self)

    def _watch(self):
        while not self._stop.wait(0.5):
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_seconds:
                print(f"tfdp: rank {self.rank}{self._where()}: training batch {self._batch} has not finished after "
                      f"{self.timeout_seconds:g} s: {self._culprit()}. Ending this worker so the job does not hang; "
                      f"if steps really take that long, raise {TIMEOUT_ENV}.", file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)

    def _where(self):
        return f" on host {self.hosts[self.rank]}" if self.hosts else ""

    def _culprit(self):
        return (lost_hosts(self.hosts, self.rank)
                or "this worker or a peer stalled (stopped submitting collectives without exiting)")
