"""Steps/s of one model on 2 workers: tfdp.MirroredStrategy + fit, a hand-written
Horovod loop, and tf.distribute.MultiWorkerMirroredStrategy + fit, side by side.

Variants run one after another in rounds (order rotated every round) so machine
noise hits all of them alike; each run's rate is its slower rank's median over
repeats, and the table shows the median over rounds.

    .venv/bin/python benchmarks/sync_vs_horovod_vs_mwms.py [--rounds 5] [--steps 200]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_sync_worker.py"
VARIANTS = ["tfdp", "horovod-loop", "mwms"]
LABELS = {
    "tfdp": "tfdp.MirroredStrategy + fit",
    "horovod-loop": "hand-written Horovod loop (grouped all-reduce)",
    "mwms": "tf.distribute.MultiWorkerMirroredStrategy + fit (patched)",
}
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TFDP_VERBOSE_WORKERS": "1"}


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(variant, out, worker_args, timeout):
    args = [sys.executable, str(WORKER), "--variant", variant, "--out", str(out), *worker_args]
    if variant == "mwms":
        hosts = [f"localhost:{p}" for p in free_ports(2)]
        procs = []
        for index in range(2):
            tf_config = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}}
            procs.append(subprocess.Popen(args, env={**ENV, "TF_CONFIG": json.dumps(tf_config)},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            if p.returncode:
                raise RuntimeError(f"{variant} failed:\n{err[-3000:]}")
        return
    horovodrun = Path(sys.executable).parent / "horovodrun"
    run = subprocess.run([str(horovodrun), "-np", "2", "-H", "localhost:2", "--gloo", *args], env=ENV,
                         capture_output=True, text=True, timeout=timeout)
    if run.returncode:
        raise RuntimeError(f"{variant} failed:\n{run.stdout[-3000:]}")


def job_rate(out, variant):
    per_rank = [json.loads((out / f"{variant}-rank{r}.json").read_text())["steps_per_second"] for r in (0, 1)]
    return min(statistics.median(rates) for rates in per_rank)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--json", default=str(HERE / "results" / "sync.json"))
    args = parser.parse_args()
    worker_args = ["--steps", args.steps, "--width", args.width, "--global-batch", args.global_batch]
    worker_args = list(map(str, worker_args))

    rates = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % 3:] + VARIANTS[: round_ % 3]
            for variant in order:
                out = Path(tmp) / f"{variant}-{round_}"
                out.mkdir()
                launch(variant, out, worker_args, timeout=900)
                rates[variant].append(job_rate(out, variant))
                print(f"round {round_ + 1}/{args.rounds} {variant:>13}: {rates[variant][-1]:6.1f} steps/s",
                      file=sys.stderr, flush=True)

    medians = {v: statistics.median(r) for v, r in rates.items()}
    base = medians["horovod-loop"]
    params = 784 * args.width + args.width + args.width * args.width + args.width + args.width * 10 + 10
    print(f"\n2 workers, MLP 784-{args.width}-{args.width}-10 ({params:,} parameters), global batch "
          f"{args.global_batch}, 1 TF thread per worker, Gloo on loopback; median of {args.rounds} rounds.\n")
    print("| variant | steps/s (median) | ms/step | vs hand-written Horovod loop | all rounds |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        all_rounds = ", ".join(f"{r:.1f}" for r in rates[v])
        print(f"| {LABELS[v]} | {medians[v]:.1f} | {1000 / medians[v]:.1f} | {medians[v] / base:.2f}x | {all_rounds} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rates": rates, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
