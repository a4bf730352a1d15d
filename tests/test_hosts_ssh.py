"""Several hosts reached over ssh by a plain horovodrun, as on real machines (full tier, root).

Each emulated host is a network namespace on a bridge running its own sshd
(`tfdp.tools.ssh_hosts.SshHosts`: keys made for the run in a temporary folder, never in
~/.ssh); horovodrun runs in a login namespace where the hosts resolve by name.
"""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import QUIET_ENV, readme_command

from tfdp.tools.launcher import run_process

pytestmark = [pytest.mark.multiprocess, pytest.mark.full,
              pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (network namespaces)")]
REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"
ENV = {**os.environ, **QUIET_ENV, "TFDP_VERBOSE_WORKERS": "0"}


def hosts(names, **options):
    from tfdp.tools.network import remove_leftovers
    from tfdp.tools.ssh_hosts import SshHosts

    remove_leftovers()  # of a run killed before it could clean up (tests run one at a time)
    return SshHosts(names, **options)


def python_command(line):
    """A README `horovodrun ... python ...` line with this venv's horovodrun and Python."""
    words = line.split()
    words[0] = str(Path(sys.executable).parent / "horovodrun")
    return [sys.executable if w == "python" else w for w in words]


def leftovers(cluster_keys):
    from tfdp.tools.network import tfdp_network_objects

    sshd = subprocess.run(["pgrep", "-f", "sshd -D -e -f"], capture_output=True, text=True).stdout.split()
    return tfdp_network_objects(), sshd, os.path.exists(cluster_keys)


def test_the_readme_bare_host_command_trains_digits_on_two_hosts_over_ssh():
    line = readme_command("More than one machine", "Bare hosts")
    assert "-H host1:2,host2:2" in line
    with hosts(["host1", "host2"], tag=92001) as cluster:
        keys = cluster.keys
        run = run_process(cluster.exec_prefix() + python_command(line), timeout=900, env=ENV)
    assert run.returncode == 0, run.output[-3000:]
    [accuracy] = [float(a) for a in re.findall(r"test accuracy: ([0-9.]+)", run.output)]  # printed once
    assert accuracy >= 0.95
    assert leftovers(keys) == ([], [], False)
    print(f"\n2 hosts x 2 slots over ssh: test accuracy {accuracy:.4f} in {run.seconds:.1f} s")


def test_two_workers_on_two_hosts_match_one_process(tmp_path):
    from test_equivalence import relative_differences

    (tmp_path / "plain").mkdir()
    (tmp_path / "hosts").mkdir()
    plain = run_process([sys.executable, WORKERS / "equivalence.py", "--model", "mlp", "--mode", "plain",
                         "--out", tmp_path / "plain"], timeout=300, env=ENV)
    assert plain.returncode == 0, plain.output[-3000:]
    with hosts(["h1", "h2"], tag=92002) as cluster:
        run = run_process(cluster.exec_prefix() + python_command(
            f"horovodrun -np 2 -H h1:1,h2:1 --gloo --network-interface eth0 python {WORKERS / 'equivalence.py'}")
            + ["--model", "mlp", "--mode", "tfdp", "--out", str(tmp_path / "hosts")], timeout=600, env=ENV)
    assert run.returncode == 0, run.output[-3000:]
    import json

    reference = json.loads((tmp_path / "plain" / "rank0.json").read_text())
    ranks = [json.loads((tmp_path / "hosts" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert max(relative_differences(ranks[0]["weights"], reference["weights"])) <= 1e-5
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_a_host_name_resolving_to_loopback_is_named_on_that_host_within_seconds():
    with hosts(["h1", "h2"], tag=92003, loopback_hostname={1}) as cluster:  # h2 maps its name to 127.0.1.1
        run = run_process(cluster.exec_prefix() + python_command(
            f"horovodrun -np 2 -H h1:1,h2:1 --gloo python {WORKERS / 'long_fit.py'}"), timeout=300, env=ENV)
    assert run.returncode != 0
    [line] = [line for line in run.output.splitlines() if "resolves to 127.0.1.1, a loopback address" in line]
    assert line.startswith("[1]<stderr>:") and "rank 1" in line  # h2 runs rank 1
    assert "/etc/hosts" in line and "HOROVOD_HOSTNAME" in line and "--network-interface" in line
    assert run.seconds < 120


def test_a_host_that_disappears_ends_the_job_within_the_step_timeout_naming_it():
    timeout = 20
    env = {**ENV, "TFDP_STEP_TIMEOUT_SECONDS": str(timeout), "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
    with hosts(["h1", "h2"], tag=92004) as cluster:
        keys = cluster.keys
        command = cluster.exec_prefix() + python_command(
            f"horovodrun -np 2 -H h1:1,h2:1 --gloo python {WORKERS / 'long_fit.py'}")
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 300
        while not any("epoch 2 done" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.hosts.take_down(1)  # h2 leaves the network mid-run
        lost = time.monotonic()
        try:
            proc.wait(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            pass  # a hang: the asserts below fail with what the job said
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        ended = time.monotonic() - lost
        reader.join(timeout=10)
    output = "".join(lines)
    said = "\n".join(line for line in lines if re.search(r"tfdp|Error|rror:|gloo|Exit code|epoch", line))
    assert proc.returncode != 0, said[-4000:]
    # Either the step outlives the timeout (the watchdog) or Horovod's Gloo notices first and
    # the step raises; rank 0 names the lost host both ways.
    assert re.search(r"rank 0 on host h1: (training batch \d+ has not finished after 20 s|a step failed "
                     r"\(\w+\)): host h2 \(ranks \[1\]\) no longer answers", output), said[-4000:]
    assert ended < timeout + 30, (ended, said[-4000:])
    assert leftovers(keys) == ([], [], False)
    print(f"\nhost h2 cut off: the job ended {ended:.1f} s later (step timeout {timeout} s)")


def test_elastic_training_grows_from_two_hosts_to_three(tmp_path):
    # horovodrun's elastic mode asks a discovery script for hosts; rank 0 adds h3 in epoch 2.
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("h1:1\nh2:1\n")
    with hosts(["h1", "h2", "h3"], tag=92005) as cluster:
        keys = cluster.keys
        command = cluster.exec_prefix() + python_command(
            f"horovodrun -np 2 --min-np 2 --max-np 3 --host-discovery-script {WORKERS / 'hosts_file.sh'} "
            f"python {WORKERS / 'elastic.py'} --out {tmp_path} --grow-hosts-file {hosts_file} --grow-host h3")
        run = run_process(command, timeout=600, env={**ENV, "TFDP_HOSTS_FILE": str(hosts_file)})
    assert run.returncode == 0, run.output[-3000:]
    import json

    result = json.loads((tmp_path / "rank0.json").read_text())
    # Only h3 can give the third worker: discovery lists one slot per host.
    assert result["sizes"] == [2, 3] and result["size"] == 3 and result["epoch"] == 12
    assert result["accuracy"] >= 0.95
    assert leftovers(keys) == ([], [], False)
    print(f"\nelastic over ssh, h1+h2 then h3: accuracy {result['accuracy']:.4f} in {run.seconds:.1f} s")
