"""Naming the hosts of a job that no longer answer (watchdog and failed steps)."""

import socket

from tfdp.strategies.watchdog import lost_hosts


def test_names_the_host_that_refuses_and_its_ranks():
    with socket.create_server(("127.0.0.2", 0)) as server:
        port = server.getsockname()[1]
        hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.3"]  # rank 0 is this host
        message = lost_hosts(hosts, 0, port)
        assert message.startswith(f"host 127.0.0.3 (ranks [2, 3]) no longer answers on port {port}")
        # Negative control: every peer host answers, nothing to name.
        assert lost_hosts(hosts[:2], 0, port) is None


def test_one_host_is_not_probed():
    assert lost_hosts(["127.0.0.3", "127.0.0.3"], 0, 1) is None
    assert lost_hosts(None, 0) is None
