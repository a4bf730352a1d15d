"""The Kubernetes recipe is a well-formed MPIJob whose command is the one the README gives."""

from pathlib import Path

import yaml
from conftest import readme_command

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "examples" / "kubernetes" / "mpijob.yaml"


def test_mpijob_manifest_has_a_launcher_and_two_workers_running_the_readme_command():
    job = yaml.safe_load(MANIFEST.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    specs = job["spec"]["mpiReplicaSpecs"]
    assert set(specs) == {"Launcher", "Worker"}
    assert specs["Launcher"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    assert job["spec"]["slotsPerWorker"] == 1
    [launcher] = specs["Launcher"]["template"]["spec"]["containers"]
    [worker] = specs["Worker"]["template"]["spec"]["containers"]
    assert worker["command"][0].endswith("sshd")  # horovodrun reaches the workers over ssh
    assert launcher["image"] == worker["image"]
    command = " ".join(launcher["command"])
    assert command == readme_command("More than one machine", "Kubernetes")
    np_ = int(launcher["command"][launcher["command"].index("-np") + 1])
    assert np_ == specs["Worker"]["replicas"] * job["spec"]["slotsPerWorker"]


def test_dockerfile_builds_the_environment_with_the_setup_script_and_sshd():
    text = (REPO / "examples" / "kubernetes" / "Dockerfile").read_text()
    assert "bash tools/setup_env.sh" in text and "openssh-server" in text
