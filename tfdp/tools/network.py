"""Several hosts on one machine: network namespaces on a bridge, with a rate-limited link each.

Each emulated host is a network namespace holding one end of a veth pair; the other end sits
on a Linux bridge in the root namespace, which also carries the bridge address (the place for
a rendezvous server). A ``tc tbf`` qdisc on both ends of every veth limits each host's link
to ``rate_mbit`` in each direction. ``netem`` is not available on these kernels; ``tbf`` is.

Bytes that really crossed a host's link are read from the host-side veth's
``/sys/class/net/<veth>/statistics``: its ``rx_bytes`` is what the host sent, ``tx_bytes``
what it received.

Needs root (CAP_NET_ADMIN). Everything created is removed on exit, on error and on Ctrl-C;
`remove_leftovers` clears what a killed launcher left behind.

Example (as root):
    >>> with EmulatedHosts(2, rate_mbit=100) as hosts:
    ...     print(hosts.addresses, hosts.bridge_address)
    ['10.213.0.1', '10.213.0.2'] 10.213.0.254
"""

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass

PREFIX = "tfdp"
_SYS_NET = "/sys/class/net"
# `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*: each host gets its own /etc/hosts.
_NETNS_ETC = "/etc/netns"


class NetworkEmulationUnavailable(RuntimeError):
    """Raised when namespaces cannot be created here (not root, or no `ip`/`tc`)."""


def _ip(*args, check=True):
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")
    return out


def _tc(namespace, *args):
    command = (["ip", "netns", "exec", namespace] if namespace else []) + ["tc", *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {out.stderr.strip()}")


def check_available():
    """Raise `NetworkEmulationUnavailable` naming what is missing."""
    if os.geteuid() != 0:
        raise NetworkEmulationUnavailable(
            "Emulated hosts need root (CAP_NET_ADMIN) to create network namespaces. "
            "Run as root, or use loopback (no --rate-mbit).")
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise NetworkEmulationUnavailable(f"`{tool}` (iproute2) is not installed; it is needed for emulated hosts.")


def _namespaces():
    """Names of all network namespaces (`ip netns list` prints `name (id: N)` per line)."""
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def remove_leftovers(prefix=PREFIX):
    """Delete namespaces and bridges named by tfdp (e.g. after a SIGKILLed launcher). Returns their names."""
    removed = []
    for name in _namespaces():
        if re.fullmatch(rf"{prefix}\d+-\d+", name):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    if os.path.isdir(_NETNS_ETC):
        for name in os.listdir(_NETNS_ETC):
            if re.fullmatch(rf"{prefix}\d+-\d+", name):
                shutil.rmtree(os.path.join(_NETNS_ETC, name), ignore_errors=True)
    for name in os.listdir(_SYS_NET):
        if re.fullmatch(rf"{prefix}br\d+|{prefix}v\d+h\d+", name):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def tfdp_network_objects(prefix=PREFIX):
    """Names of tfdp namespaces and links that exist now."""
    return sorted(n for n in _namespaces() + os.listdir(_SYS_NET) if n.startswith(prefix))


@dataclass(frozen=True)
class LinkBytes:
    sent: int
    received: int


INTERFACE = "eth0"  # every host's link has this name in its namespace, as on real machines


class EmulatedHosts:
    """`count` namespaces on one bridge, each link limited to `rate_mbit` (None: unlimited).

    `tag` makes names unique per launcher (default: this process id); `subnet` is a /24
    prefix such as "10.213.0". Each host's link is `INTERFACE` inside its namespace, and
    every host resolves every host's name (`names`, default host0, host1, ...) and this
    machine's host name (to its own address, or to 127.0.1.1 for the hosts in
    `loopback_hostname`, as Debian maps it by default). With `login`, one more namespace on
    the bridge (no rate limit) from which a launcher reaches the hosts by name.
    """

    def __init__(self, count, rate_mbit=None, tag=None, subnet=None, names=None, login=False,
                 loopback_hostname=()):
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"`count` must be an int >= 1. Received: {count!r}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"`rate_mbit` must be > 0 (or None for no limit). Received: {rate_mbit!r}")
        if count > 250:
            raise ValueError(f"At most 250 emulated hosts fit one /24 subnet. Received: {count}")
        self.count = count
        self.rate_mbit = rate_mbit
        self.tag = int(tag if tag is not None else os.getpid() % 100000)
        self.subnet = subnet or f"10.{200 + self.tag % 50}.{self.tag // 50 % 256}"
        self.bridge = f"{PREFIX}br{self.tag}"
        self.names = list(names or [f"host{i}" for i in range(count)])
        if len(self.names) != count:
            raise ValueError(f"`names` must name {count} hosts. Received: names={names!r}")
        self.namespaces = [f"{PREFIX}{self.tag}-{i}" for i in range(count)]
        self.host_links = [f"{PREFIX}v{self.tag}h{i}" for i in range(count)]
        self._peer_links = [f"{PREFIX}v{self.tag}n{i}" for i in range(count)]
        self.inner_links = [INTERFACE] * count
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(count)]
        self.bridge_address = f"{self.subnet}.254"
        self.loopback_hostname = set(loopback_hostname)
        # The login namespace is host number `count` everywhere below (address .253).
        self.login = f"{PREFIX}{self.tag}-{count}" if login else None
        self._login_links = (f"{PREFIX}v{self.tag}h{count}", f"{PREFIX}v{self.tag}n{count}")
        self.login_address = f"{self.subnet}.253"
        self._up = False

    def __enter__(self):
        check_available()
        if os.path.exists(os.path.join(_SYS_NET, self.bridge)):  # not ours: leave it as it is
            raise RuntimeError(f"The bridge {self.bridge} already exists: another EmulatedHosts with tag {self.tag} is "
                               "running, or a killed one left it behind. Use another tag, or remove what tfdp left "
                               "with `python -c 'from tfdp.tools import network; network.remove_leftovers()'`.")
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        self._up = True
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def _create(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, address in enumerate(self.addresses):
            self._add_host(self.namespaces[i], self.host_links[i], self._peer_links[i], address, i)
            if self.rate_mbit is not None:
                # Both ends: the host's uplink (namespace side) and its downlink (bridge side).
                self._limit(None, self.host_links[i])
                self._limit(self.namespaces[i], INTERFACE)
        if self.login:
            self._add_host(self.login, *self._login_links, self.login_address, None)

    def _add_host(self, ns, host_link, peer_link, address, index):
        _ip("netns", "add", ns)
        _ip("link", "add", host_link, "type", "veth", "peer", "name", peer_link)
        _ip("link", "set", peer_link, "netns", ns)
        _ip("-n", ns, "link", "set", peer_link, "name", INTERFACE)
        _ip("link", "set", host_link, "master", self.bridge)
        _ip("link", "set", host_link, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", INTERFACE)
        _ip("-n", ns, "link", "set", INTERFACE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self._write_hosts_file(ns, address, index)

    def _write_hosts_file(self, namespace, address, index):
        # Horovod 0.28.1 builds its process-set Gloo device without HOROVOD_GLOO_IFACE, from the
        # address this machine's hostname resolves to; inside a host that must be the host's address.
        own = "127.0.1.1" if index in self.loopback_hostname else address
        lines = ["127.0.0.1 localhost", f"{own} {socket.gethostname()}"]
        lines += [f"{a} {n}" for a, n in zip(self.addresses, self.names)]
        os.makedirs(os.path.join(_NETNS_ETC, namespace), exist_ok=True)
        with open(os.path.join(_NETNS_ETC, namespace, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _limit(self, namespace, link):
        rate_bits = self.rate_mbit * 1e6
        # The bucket must hold at least one timer tick of traffic (HZ >= 100) and a few full segments.
        burst = max(64 * 1024, int(rate_bits / 8 / 100))
        _tc(namespace, "qdisc", "add", "dev", link, "root", "tbf", "rate", f"{int(rate_bits)}bit",
            "burst", str(burst), "latency", "100ms")

    def remove(self):
        """Delete every namespace, veth and the bridge (idempotent)."""
        for ns in self.namespaces + ([self.login] if self.login else []):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(_NETNS_ETC, ns), ignore_errors=True)
        login_link = [self._login_links[0]] if self.login else []
        for link in self.host_links + login_link + [self.bridge]:
            if os.path.exists(os.path.join(_SYS_NET, link)):
                _ip("link", "del", link, check=False)
        self._up = False

    def exec_prefix(self, host):
        """The command prefix that runs a program inside emulated host `host` (None: the login host)."""
        return ["ip", "netns", "exec", self.login if host is None else self.namespaces[host]]

    def take_down(self, host):
        """Cut host `host` off the network (its link goes down), as if it had failed."""
        _ip("-n", self.namespaces[host], "link", "set", INTERFACE, "down")

    def link_bytes(self, host):
        """`LinkBytes` that crossed host `host`'s link so far (from the bridge-side veth counters)."""
        stats = os.path.join(_SYS_NET, self.host_links[host], "statistics")
        with open(os.path.join(stats, "rx_bytes")) as rx, open(os.path.join(stats, "tx_bytes")) as tx:
            return LinkBytes(sent=int(rx.read()), received=int(tx.read()))
