"""Launch N Horovod workers: through horovodrun, or directly on loopback or emulated hosts.

The one launcher of tfdp: `tfdp run` (`horovodrun_command`), `tfdp bench`, the benchmarks
and the tests all start workers here, each job with a hard timeout (a hang is a failure).

- ``launch(..., use_horovodrun=True)`` runs horovodrun itself (the user's path), in its own
  process group; its output is captured and the whole group is killed on timeout.
- ``launch(...)`` without horovodrun starts the workers directly (needed for emulated
  hosts, where each worker runs inside its network namespace).

Directly started workers get Horovod's Gloo environment contract (``HOROVOD_RANK``,
``HOROVOD_SIZE``, local and cross ranks, ``HOROVOD_HOSTNAME``,
``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``, ``HOROVOD_CONTROLLER=gloo``,
``HOROVOD_CPU_OPERATIONS=gloo``, ``HOROVOD_GLOO_IFACE``) and meet at Horovod's own
rendezvous server, bound to one address only: the bridge of the emulated
hosts, or 127.0.0.1 on loopback. Output lines are prefixed ``[rank]<stdout>:`` like horovodrun.

Like horovodrun, the first worker to fail ends the job: the others are terminated, and the
result names the failed rank. A timeout or Ctrl-C also ends every worker (their whole process
groups), and the emulated network is removed in every case.

Example:
    >>> result = launch([sys.executable, "train.py"], workers=2, use_horovodrun=True, timeout=300)
    >>> result = launch([sys.executable, "train.py"], workers=2, rate_mbit=100)  # as root
    >>> result.returncode, result.failed_rank, result.link_bytes[0].sent
"""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from tfdp._compat.horovod import start_rendezvous
from tfdp.tools.network import EmulatedHosts

TERMINATE_GRACE_SECONDS = 5.0


@dataclass
class LaunchResult:
    returncode: int  # 0 when every worker exited 0
    seconds: float
    failed_rank: int | None = None  # the first rank to exit non-zero (or None)
    failed_code: int | None = None
    timed_out: bool = False
    link_bytes: list = field(default_factory=list)  # per host `LinkBytes` (emulated hosts only)
    output: str = ""


def horovodrun_invocation():
    """argv that starts horovodrun with this Python (the one tfdp and its Horovod live in).

    horovodrun's own command line, with its Gloo/MPI build checks remembered between
    launches (`tfdp._compat.horovodrun`: each check otherwise imports TensorFlow, ~4 s).
    """
    if importlib.util.find_spec("horovod") is None or importlib.util.find_spec("horovod.runner") is None:
        raise ValueError("horovodrun not found. Install Horovod with `bash tools/setup_env.sh`.")
    return [sys.executable, "-m", "tfdp._compat.horovodrun"]


def horovodrun_command(command, workers, hosts=None, horovodrun_args=()):
    """argv of ``horovodrun -np N -H HOSTS --gloo [args] command``.

    `hosts` defaults to ``localhost:N``; pass ``hosts=False`` when `horovodrun_args` name the
    hosts another way (``--host-discovery-script``). Gloo unless the args choose ``--mpi``.
    """
    argv = [*horovodrun_invocation(), "-np", str(workers)]
    if hosts is not False:
        argv += ["-H", hosts or f"localhost:{workers}"]
    if not {"--gloo", "--mpi"} & set(horovodrun_args):
        argv.append("--gloo")
    return argv + list(horovodrun_args) + list(command)


def run_process(command, timeout=None, env=None, sink=None):
    """Run `command` in its own process group; kill the group at `timeout`. Returns a `LaunchResult`.

    stdout and stderr are merged, in order, into ``result.output`` (and echoed to `sink`).
    """
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines = []

    def pump():
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)
            if sink is not None:
                sink.write(line)
                sink.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    except BaseException:
        _end([proc])
        raise
    finally:
        if proc.poll() is None:
            _end([proc])
    reader.join(timeout=5)
    result = LaunchResult(returncode=124 if timed_out else proc.returncode, seconds=time.monotonic() - start,
                          timed_out=timed_out, output="".join(lines))
    failed = re.search(r"The first process to do so was:\s*\nProcess name: (\d+)\s*\nExit code: (-?\d+)", result.output)
    if failed:
        result.failed_rank, result.failed_code = int(failed.group(1)), int(failed.group(2))
    return result


def _worker_env(slot, address, port, iface, base_env):
    env = dict(base_env)
    env.update({
        "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": address, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": iface,
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _pump(stream, rank, name, sink, lines, lock):
    for line in iter(stream.readline, ""):
        text = f"[{rank}]<{name}>:{line}"
        with lock:
            lines.append(text)
            if sink is not None:
                sink.write(text)
                sink.flush()
    stream.close()


def _wait(process, rank, exits, lock):
    code = process.wait()
    with lock:
        exits.append((time.monotonic(), rank, code))


def _end(processes):
    """SIGTERM every live worker's process group, then SIGKILL what is left after a grace period."""
    for sig, wait in ((signal.SIGTERM, TERMINATE_GRACE_SECONDS), (signal.SIGKILL, TERMINATE_GRACE_SECONDS)):
        live = [p for p in processes if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)


def launch(command, workers, rate_mbit=None, emulate=None, timeout=None, env=None, sink=sys.stdout, tag=None,
           use_horovodrun=False, hosts=None, horovodrun_args=(), pin_cpus=False):
    """Run `command` (argv list) on `workers` workers; return a `LaunchResult`.

    With `use_horovodrun`, horovodrun starts them (`hosts`, `horovodrun_args` as in
    `horovodrun_command`). Otherwise they start here: `emulate` (default: when `rate_mbit`
    is given) puts each worker in its own emulated host linked at `rate_mbit` Mbit/s, else
    all run on 127.0.0.1. `pin_cpus` runs worker r on the r-th usable CPU alone (``taskset``), as on hosts
    of one CPU each; it needs at least `workers` CPUs. `timeout` (seconds) ends a job that runs
    too long (exit 124): a hang is a failure. `sink` receives the prefixed output live.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"`workers` must be an int >= 1. Received: {workers!r}")
    cpus = sorted(os.sched_getaffinity(0))  # the CPUs this process may use, in a container too
    if pin_cpus and (use_horovodrun or workers > len(cpus)):
        raise ValueError(f"`pin_cpus` gives each of the {workers} workers a CPU of its own: it needs workers started "
                         f"here (not horovodrun) and at least {workers} CPUs; this process may use {len(cpus)}.")
    if use_horovodrun:
        if rate_mbit is not None or emulate:
            raise ValueError("Emulated hosts run workers directly: pass use_horovodrun=False with rate_mbit.")
        return run_process(horovodrun_command(command, workers, hosts, horovodrun_args), timeout,
                           dict(os.environ if env is None else env), sink)
    emulate = rate_mbit is not None if emulate is None else emulate
    base_env = dict(os.environ if env is None else env)
    hosts = EmulatedHosts(workers, rate_mbit, tag=tag) if emulate else None
    processes, threads, lines, lock = [], [], [], threading.Lock()
    exits = []  # (time, rank, code) in the order the workers ended
    server = None
    start = time.monotonic()
    result = LaunchResult(returncode=0, seconds=0.0)
    try:
        if hosts is not None:
            hosts.__enter__()
            address = hosts.bridge_address
            hostnames = ",".join(f"host{i}:1" for i in range(workers))
        else:
            address, hostnames = "127.0.0.1", f"localhost:{workers}"
        server, port, plan = start_rendezvous(address, hostnames)
        for slot in plan:
            iface = hosts.inner_links[slot.rank] if hosts is not None else "lo"
            prefix = hosts.exec_prefix(slot.rank) if hosts is not None else []
            if pin_cpus:
                prefix += ["taskset", "--cpu-list", str(cpus[slot.rank])]
            p = subprocess.Popen(prefix + list(command), env=_worker_env(slot, address, port, iface, base_env),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            processes.append(p)
            threading.Thread(target=_wait, args=(p, slot.rank, exits, lock), daemon=True).start()
            for stream, name in ((p.stdout, "stdout"), (p.stderr, "stderr")):
                t = threading.Thread(target=_pump, args=(stream, slot.rank, name, sink, lines, lock), daemon=True)
                t.start()
                threads.append(t)
        while True:
            with lock:
                failed = [(r, c) for _, r, c in sorted(exits) if c != 0]
                done = len(exits) == len(processes)
            if failed:
                result.failed_rank, result.failed_code = failed[0]
                break
            if done:
                break
            if timeout is not None and time.monotonic() - start > timeout:
                result.timed_out = True
                break
            time.sleep(0.05)
    finally:
        # Also on Ctrl-C and on errors: no worker and no namespace outlives the launcher.
        _end(processes)
        if hosts is not None and hosts._up:
            result.link_bytes = [hosts.link_bytes(i) for i in range(workers)]
        if hosts is not None:
            hosts.remove()
        if server is not None:
            server.shutdown()
            server.server_close()
    for t in threads:
        t.join(timeout=5)
    result.seconds = time.monotonic() - start
    result.output = "".join(lines)
    if result.failed_rank is not None:
        result.returncode = result.failed_code if result.failed_code > 0 else 128 - result.failed_code
        message = (f"tfdp launcher: rank {result.failed_rank} exited with status {result.failed_code}; "
                   f"the other workers were terminated.\n")
    elif result.timed_out:
        result.returncode = 124
        message = f"tfdp launcher: the job ran past its {timeout:g} s timeout; every worker was terminated.\n"
    else:
        message = ""
    if message:
        result.output += message
        if sink is not None:
            sink.write(message)
    return result
