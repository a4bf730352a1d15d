"""Steps/s of one model on 2 workers: tfdp.MirroredStrategy + fit, a hand-written
Horovod loop, and tf.distribute.MultiWorkerMirroredStrategy + fit, side by side.

This machine is shared and noisy (the same job varies by 30% between minutes), so the
tfdp and Horovod variants alternate short timed blocks inside the same two worker
processes: load drifts hit them alike, and the ratio is taken block by block. Each
block's rate is the slower rank's. MWMS needs its own runtime, so it runs as a
separate job right after.

    .venv/bin/python benchmarks/sync_vs_horovod_vs_mwms.py [--blocks 20] [--steps 50]
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

from tfdp.tools.launcher import launch as launch_workers

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_sync_worker.py"
LABELS = {
    "tfdp": "tfdp.MirroredStrategy + fit",
    "horovod-loop": "hand-written Horovod loop (grouped all-reduce)",
    "mwms": "tf.distribute.MultiWorkerMirroredStrategy + fit (patched for Keras 3)",
    "horovod-fit": "diagnostic: Keras fit, hand-written Horovod train_step, local logs",
    "tfdp-local-metrics": "tfdp.MirroredStrategy(global_step_logs=False) + fit",
    "tfdp-one-group": "diagnostic: tfdp.MirroredStrategy(bucket_bytes=None) + fit (no buckets)",
    "horovod-loop-metric": "diagnostic: Horovod loop + one scalar all-reduce per step",
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


def launch(variant, out, worker_args, timeout=1800):
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
    run = launch_workers(args, 2, use_horovodrun=True, timeout=timeout, env=ENV, sink=None)
    if run.returncode:
        raise RuntimeError(f"{variant} failed:\n{run.output[-3000:]}")


def job_rates(out, variant):
    """Per trainer: per-block steps/s of the slower rank."""
    ranks = [json.loads((out / f"{variant}-rank{r}.json").read_text()) for r in (0, 1)]
    return {name: [min(a, b) for a, b in zip(ranks[0][name], ranks[1][name])] for name in ranks[0]}


def per_block_ratio(rates, base):
    """Median over blocks of `rates` / `base`, block by block (variants timed in the same blocks)."""
    return statistics.median(r / b for r, b in zip(rates, base))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--inter-op-threads", type=int, default=1,
                        help="TensorFlow inter-op threads per worker: with 2, tfdp's gradient buckets "
                             "can be all-reduced while backprop goes on (docs/guide.md)")
    parser.add_argument("--json", default=str(HERE / "results" / "sync.json"))
    args = parser.parse_args()
    worker_args = [str(a) for a in ("--steps", args.steps, "--repeats", args.blocks, "--width", args.width,
                                    "--global-batch", args.global_batch, "--inter-op-threads",
                                    args.inter_op_threads)]
    with tempfile.TemporaryDirectory() as tmp:
        rates = {}
        for variant in ("paired", "mwms"):
            out = Path(tmp) / variant
            out.mkdir()
            print(f"running {variant} ...", file=sys.stderr, flush=True)
            launch(variant, out, worker_args)
            rates.update(job_rates(out, variant))

    base = rates["horovod-loop"]
    paired = [n for n in rates if n != "mwms"]
    params = 784 * args.width + args.width + args.width * args.width + args.width + args.width * 10 + 10
    print(f"\n2 workers, MLP 784-{args.width}-{args.width}-10 ({params:,} parameters), global batch "
          f"{args.global_batch}, 1 intra-op and {args.inter_op_threads} inter-op TF thread(s) per worker, "
          f"Gloo on loopback. {args.blocks} blocks of "
          f"{args.steps} steps; tfdp and Horovod variants alternate blocks in the same processes.\n")
    print("| variant | steps/s (median) | ms/step | vs hand-written Horovod loop (median of per-block ratios) |")
    print("|---|---|---|---|")
    order = ["tfdp", "tfdp-local-metrics", "tfdp-one-group", "horovod-loop", "mwms", "horovod-fit",
             "horovod-loop-metric"]
    for name in (n for n in order if n in rates):
        median = statistics.median(rates[name])
        if name in paired:
            ratio = per_block_ratio(rates[name], base)
        else:  # Separate job: ratio of medians.
            ratio = median / statistics.median(base)
        print(f"| {LABELS[name]} | {median:.1f} | {1000 / median:.1f} | {ratio:.2f}x |")
    print()
    for name in ("tfdp", "tfdp-one-group"):
        if name in rates:
            print(f"{LABELS[name]} against Keras fit with a hand-written Horovod train_step (median of "
                  f"per-block ratios): {per_block_ratio(rates[name], rates['horovod-fit']):.3f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rates": rates}, indent=1))


if __name__ == "__main__":
    main()
