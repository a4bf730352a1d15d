"""Emulated heterogeneity: make one worker FACTOR times slower in compute with a CPU quota.

A real CPU limit, not a sleep: the worker's whole process (every thread) joins a cgroup
whose CFS quota is ``cpus / FACTOR`` CPUs, so it computes like a slower machine and its
collectives still answer at once. cgroup v1 (``/sys/fs/cgroup/cpu/<group>/
cpu.cfs_quota_us``) and v2 (``/sys/fs/cgroup/<group>/cpu.max``) both work; either needs
root. ``tfdp bench --slowdown 1:2`` and the balance tests use it through the environment
variable ``TFDP_SLOWDOWN`` (``RANK:FACTOR[,RANK:FACTOR...]``), read by each worker at start.

Example:
    >>> parse_slowdown("1:2,3:1.5")
    {1: 2.0, 3: 1.5}
"""

import os
import subprocess
from pathlib import Path

SLOWDOWN_ENV = "TFDP_SLOWDOWN"
PERIOD_US = 10_000  # short periods: the quota bites evenly, not in 50 ms stalls
GROUP_PREFIX = "tfdp-slow-"
CGROUP_MOUNTS = (Path("/sys/fs/cgroup"),)
# `ip netns exec` (emulated hosts) gives the process its own mount namespace with a fresh
# /sys that lacks the cgroup file systems; mounting the cpu hierarchy again there shows the
# host's hierarchy (the same groups), and the mount is private to that namespace.
PRIVATE_MOUNT = Path("/tmp/tfdp-cgroup")


def parse_slowdown(text):
    """``"RANK:FACTOR,..."`` -> {rank: factor}; a clear ValueError on anything else."""
    result = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        rank, sep, factor = part.partition(":")
        try:
            rank, factor = int(rank), float(factor)
        except ValueError:
            rank = factor = None
        if not sep or rank is None or rank < 0 or not factor >= 1.0:
            raise ValueError(f"Bad slowdown {part!r}: expected RANK:FACTOR with RANK >= 0 and FACTOR >= 1, "
                             "e.g. --slowdown 1:2 (rank 1 computes 2x slower).")
        result[rank] = factor
    return result


def _layout():
    """("v1" or "v2", the directory groups are made in), or None without a cgroup cpu controller."""
    for mount in (*CGROUP_MOUNTS, PRIVATE_MOUNT):
        try:
            if (mount / "cpu" / "cpu.cfs_quota_us").exists():
                return "v1", mount / "cpu"
            controllers = mount / "cgroup.controllers"
            if controllers.exists() and "cpu" in controllers.read_text().split():
                return "v2", mount
        except OSError:
            continue
    return None


def _mount_privately():
    """Mount the cpu hierarchy at `PRIVATE_MOUNT` (inside `ip netns exec`); return `_layout()`
    and the mount point to unmount once the process has joined its group."""
    PRIVATE_MOUNT.mkdir(parents=True, exist_ok=True)
    for command in (["mount", "-t", "cgroup", "-o", "cpu", "cgroup", str(PRIVATE_MOUNT / "cpu")],
                    ["mount", "-t", "cgroup2", "cgroup2", str(PRIVATE_MOUNT)]):
        Path(command[-1]).mkdir(parents=True, exist_ok=True)
        if subprocess.run(command, capture_output=True).returncode == 0:
            return _layout(), command[-1]
    return None, None


def slow_down(pid, factor, cpus=1.0):
    """Limit process `pid` (all its threads) to ``cpus / factor`` CPUs; return the cgroup's path."""
    found, mounted = _layout(), None
    if found is None and not any(CGROUP_MOUNTS[0].iterdir()):  # a fresh /sys, as `ip netns exec` gives
        found, mounted = _mount_privately()
    if found is None:
        raise RuntimeError("tfdp slowdown needs the cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 "
                           "/sys/fs/cgroup with 'cpu' in cgroup.controllers); none is mounted here.")
    layout, root = found
    group = root / f"{GROUP_PREFIX}{pid}"
    quota = max(1000, int(PERIOD_US * cpus / factor))
    try:
        group.mkdir(exist_ok=True)
        if layout == "v1":
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        (group / "cgroup.procs").write_text(str(pid))
    except PermissionError as err:
        raise RuntimeError(f"tfdp slowdown: cannot write the cgroup {group} ({err}). It needs root; run as root "
                           f"or drop --slowdown / {SLOWDOWN_ENV}.") from err
    finally:
        if mounted:  # the process stays in its group; the group stays visible on the host
            subprocess.run(["umount", mounted], capture_output=True)
    return group


def apply_from_env(rank=None, cpus=None):
    """Slow this process down if ``TFDP_SLOWDOWN`` names its rank; return the factor (1.0 if not).

    `cpus` defaults to ``TF_NUM_INTRAOP_THREADS`` (the CPUs one worker would use), else 1.
    """
    text = os.environ.get(SLOWDOWN_ENV)
    if not text:
        return 1.0
    rank = int(os.environ.get("HOROVOD_RANK", "0")) if rank is None else rank
    factor = parse_slowdown(text).get(rank, 1.0)
    if factor > 1.0:
        cpus = cpus or float(os.environ.get("TF_NUM_INTRAOP_THREADS") or 1)
        slow_down(os.getpid(), factor, cpus)
    return factor


def remove_groups():
    """Remove the cgroups `slow_down` made whose processes have ended (call after a job)."""
    found = _layout()
    if found is None:
        return
    for group in found[1].glob(f"{GROUP_PREFIX}*"):
        try:
            if not (group / "cgroup.procs").read_text().strip():
                group.rmdir()
        except OSError:
            pass
