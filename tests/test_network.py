"""Emulated hosts and the launcher: real namespaces, real Horovod workers, clean-up in every case."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import QUIET_ENV, WORKERS

from tfdp._compat.horovod import start_rendezvous
from tfdp.tools import network
from tfdp.tools.launcher import launch

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (CAP_NET_ADMIN)")
pytestmark = [pytest.mark.multiprocess, pytest.mark.full]

WORKER = [sys.executable, str(WORKERS / "launched.py")]
ENV = {**os.environ, **QUIET_ENV}


def _objects(tag):
    """tfdp namespaces, links and /etc/netns entries of launcher `tag` that still exist."""
    names = network.tfdp_network_objects()
    if os.path.isdir("/etc/netns"):
        names += os.listdir("/etc/netns")
    return [n for n in names if n.startswith((f"tfdp{tag}-", f"tfdpbr{tag}", f"tfdpv{tag}"))]


def _pids(output):
    return [int(line.split("pid ")[1].split()[0]) for line in output.splitlines() if "<stdout>:pid " in line]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_without_root_the_error_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(network.NetworkEmulationUnavailable, match="need root"):
        network.check_available()


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="rate_mbit"):
        network.EmulatedHosts(2, rate_mbit=0)
    with pytest.raises(ValueError, match="count"):
        network.EmulatedHosts(0)
    usable = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"at least {usable + 1} CPUs"):
        launch(WORKER + ["--case", "ok"], usable + 1, pin_cpus=True, sink=None)


def test_pinned_workers_each_run_on_a_cpu_of_their_own():
    # `tfdp bench --pin-cpus`: hosts of one CPU each (the overlap benchmarks in docs/results.md).
    pinned = launch(WORKER + ["--case", "ok"], 2, pin_cpus=True, timeout=120, env=ENV, sink=None)
    assert pinned.returncode == 0, pinned.output[-3000:]
    usable = sorted(os.sched_getaffinity(0))  # what the launcher pins to, in a container too
    assert f"rank 0 iface lo cpus [{usable[0]}]" in pinned.output
    assert f"rank 1 iface lo cpus [{usable[1]}]" in pinned.output
    free = launch(WORKER + ["--case", "ok"], 2, timeout=120, env=ENV, sink=None)  # the control: not pinned
    assert free.output.count(f"cpus {usable}") == 2, free.output[-3000:]


def test_rendezvous_listens_on_the_given_address_only():
    server, port, _ = start_rendezvous("127.0.0.1", "localhost:1")
    try:
        assert server.server_address == ("127.0.0.1", port)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]
        if not others:
            pytest.skip("this machine has no non-loopback address to try")
        other = others[0]
        with pytest.raises(OSError):  # Refused: the server is not on every interface.
            socket.create_connection((other, port), timeout=5).close()
    finally:
        server.shutdown()
        server.server_close()


@needs_root
def test_two_hosts_allreduce_across_the_bridge():
    result = launch(WORKER + ["--case", "ok"], 2, rate_mbit=1000, timeout=120, env=ENV, sink=None, tag=90001)
    assert result.returncode == 0, result.output[-3000:]
    assert result.output.count("<stdout>:sum 1 size 2") == 2
    # Each worker is on its own host, whose link is eth0 as on a real machine.
    assert result.output.count("iface eth0") == 2
    # The all-reduce crossed the emulated links: each host sent and received something.
    assert all(b.sent > 0 and b.received > 0 for b in result.link_bytes)
    assert _objects(90001) == []


@needs_root
def test_failed_worker_ends_the_job_and_the_network_is_removed():
    result = launch(WORKER + ["--case", "fail"], 2, rate_mbit=100, timeout=120, env=ENV, sink=None, tag=90002)
    assert (result.failed_rank, result.failed_code, result.returncode) == (1, 3, 3), result.output[-3000:]
    assert "rank 1 exited with status 3" in result.output
    assert result.seconds < 60
    assert _objects(90002) == []
    assert not any(_alive(pid) for pid in _pids(result.output))


@needs_root
def test_timeout_ends_a_hung_job_and_the_network_is_removed():
    result = launch(WORKER + ["--case", "hang"], 2, rate_mbit=100, timeout=5, env=ENV, sink=None, tag=90003)
    assert result.timed_out and result.returncode == 124
    assert result.seconds < 30
    pids = _pids(result.output)
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
    assert _objects(90003) == []


@needs_root
def test_ctrl_c_removes_workers_and_network():
    code = ("import sys; from tfdp.tools.launcher import launch\n"
            f"launch({WORKER + ['--case', 'hang']!r}, 2, rate_mbit=100, timeout=120, tag=90004)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV)
    deadline = time.monotonic() + 60
    lines = []
    while len([line for line in lines if "<stdout>:pid " in line]) < 2 and time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
    assert _objects(90004), "the network should exist while the job runs"
    proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the launcher did not stop within 30 s of Ctrl-C")
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in rest
    pids = _pids("".join(lines))
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
    assert _objects(90004) == []


@needs_root
def test_leftovers_of_a_killed_launcher_are_removed():
    hosts = network.EmulatedHosts(2, tag=90005)
    hosts.__enter__()  # No __exit__: as if the launcher had been SIGKILLed.
    assert len(_objects(90005)) >= 3
    removed = network.remove_leftovers()
    assert "tfdp90005-0" in removed and "tfdpbr90005" in removed
    assert _objects(90005) == []


@needs_root
def test_a_second_network_with_the_same_tag_is_refused_and_the_first_kept():
    with network.EmulatedHosts(1, tag=90006):
        before = _objects(90006)
        with pytest.raises(RuntimeError, match="tfdpbr90006 already exists.*remove_leftovers"):
            network.EmulatedHosts(1, tag=90006).__enter__()
        assert _objects(90006) == before  # the running one is untouched
    assert _objects(90006) == []
