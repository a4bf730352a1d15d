"""Emulated hosts that run an OpenSSH server, so a plain ``horovodrun -H h1:2,h2:2`` reaches them.

Each emulated host (a network namespace, see `tfdp.tools.network.EmulatedHosts`) runs its
own ``sshd``, listening on the host's address only. Keys are generated for this run into a
temporary folder, never into ``~/.ssh``: the client key is authorised on every host, and
the ssh client configuration that uses it lives in the login namespace's own ``/etc/ssh``
(``/etc/netns/<login>/ssh``, mounted there by ``ip netns exec``). Launch from the login
namespace (`exec_prefix`), where the hosts resolve by name, exactly as from a machine of a
cluster. Everything (sshd processes, keys, namespaces) is removed on exit, error or Ctrl-C.

Needs root and ``/usr/sbin/sshd``: Debian's ``openssh-server``, installed on first use
when missing (``apt-get install openssh-server``).

Example (as root):
    >>> with SshHosts(["h1", "h2"]) as cluster:
    ...     subprocess.run(cluster.exec_prefix() + ["horovodrun", "-np", "4", "-H", "h1:2,h2:2", "--gloo",
    ...                                             "python", "train.py"])
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time

from tfdp.tools.network import _NETNS_ETC, EmulatedHosts, NetworkEmulationUnavailable, check_available

SSHD = "/usr/sbin/sshd"


def ensure_sshd():
    """Install Debian's openssh-server if `SSHD` is missing; raise `NetworkEmulationUnavailable` if that fails."""
    if os.path.exists(SSHD):
        return
    check_available()  # root
    if shutil.which("apt-get") is None:
        raise NetworkEmulationUnavailable(f"{SSHD} is missing and apt-get is not available to install openssh-server.")
    for command in (["apt-get", "install", "-y", "-q", "openssh-server"],
                    ["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "openssh-server"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode == 0 and os.path.exists(SSHD):
            return
    raise NetworkEmulationUnavailable(f"Could not install openssh-server: {done.stderr.strip()[-500:]}")


class SshHosts:
    """Emulated hosts named `names`, each running sshd, and a login namespace to launch from.

    Keyword arguments go to `EmulatedHosts` (``rate_mbit``, ``tag``, ``loopback_hostname``).
    """

    def __init__(self, names, **hosts_options):
        self.hosts = EmulatedHosts(len(names), names=names, login=True, **hosts_options)
        self.names = list(names)
        self.keys = None
        self._servers = []

    def __enter__(self):
        ensure_sshd()
        try:
            self.hosts.__enter__()
            self.keys = tempfile.mkdtemp(prefix="tfdp-ssh-")
            self._make_keys()
            self._write_client_config()
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
            for index in range(len(self.names)):
                self._servers.append(self._start_sshd(index))
            self._wait_until_reachable()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def _run(self, *command):
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def _make_keys(self):
        self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(self.keys, "id"))
        self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(self.keys, "host_key"))
        shutil.copy(os.path.join(self.keys, "id.pub"), os.path.join(self.keys, "authorized_keys"))

    def _write_client_config(self):
        folder = os.path.join(_NETNS_ETC, self.hosts.login, "ssh")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "ssh_config"), "w") as f:
            f.write(f"Host *\n  IdentityFile {self.keys}/id\n  UserKnownHostsFile {self.keys}/known_hosts\n"
                    "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n")

    def _start_sshd(self, index):
        config = os.path.join(self.keys, f"sshd_config.{index}")
        with open(config, "w") as f:
            f.write(f"ListenAddress {self.hosts.addresses[index]}\nPort 22\nHostKey {self.keys}/host_key\n"
                    f"AuthorizedKeysFile {self.keys}/authorized_keys\nPidFile {self.keys}/sshd.{index}.pid\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\nUsePAM no\n"
                    "LogLevel ERROR\n")
        return subprocess.Popen(self.hosts.exec_prefix(index) + [SSHD, "-D", "-e", "-f", config],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    def _wait_until_reachable(self, seconds=30):
        deadline = time.monotonic() + seconds
        for name in self.names:
            while True:
                probe = subprocess.run(self.exec_prefix() + ["ssh", name, "true"], capture_output=True, text=True,
                                       timeout=30)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {name} did not answer within {seconds} s: {probe.stderr.strip()}")
                time.sleep(0.2)

    def exec_prefix(self):
        """The command prefix that runs a program on the login host (where the hosts resolve by name)."""
        return self.hosts.exec_prefix(None)

    def remove(self):
        """Stop every sshd and remove the keys and the network (idempotent)."""
        for server in self._servers:
            if server.poll() is None:
                try:
                    os.killpg(server.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            server.wait(timeout=10)
        self._servers = []
        if self.keys:
            shutil.rmtree(self.keys, ignore_errors=True)
            self.keys = None
        self.hosts.remove()
