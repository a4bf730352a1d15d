"""Dense versus every compressor on digits, 2 workers, side by side in one run.

Every configuration (a shipped preset, or an explicit variant of one) trains the digits
conv net (`tfdp.tools.workloads`, 33.8k parameters) inside the same two horovodrun
workers, one after the other, for the same epochs, global batch and seeds. Prints per
configuration: median time per step (and its ratio to sync), gradient bytes per step
handed to collectives by one worker (and the ratio to float32), and mean test accuracy
over the seeds.

    .venv/bin/python benchmarks/compression.py [--optimizer adam] [--seeds 0 1 2] [--epochs 20]

On loopback with 2 cores the step is compute-bound, so time per step shows the
compressors' compute overhead, not their savings on a slow link (see issue 5's
emulated hosts for that).
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import _launch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_preset_worker.py"
# Shipped presets, and variants of them (`tfdp.presets`): printed as they are run.
CONFIGS = ["sync", "fp16", "bf16", "qsgd", "fp16:compressor.name=randomk,compressor.ratio=0.1,error_feedback=false",
           "topk-1pct", "efsign", "powersgd-r4:compressor.rank=2", "powersgd-r4",
           "topk-1pct:compressor.ratio=0.001,error_feedback=false,local_residual=false"]


def run_job(out, args):
    return _launch.run_job(WORKER, out, ["--optimizer", args.optimizer, "--epochs", args.epochs,
                                         "--seeds", *args.seeds, "--configs", *CONFIGS], timeout=7200)


def summarise(ranks):
    """Per config: the slower rank's seconds per step, bytes per step, accuracies."""
    rows = {}
    for r0, r1 in zip(*ranks):
        row = rows.setdefault(r0["config"], {"seconds": [], "accuracy": [], "bytes": [], "dense": []})
        row["seconds"].append(max(r0["seconds_per_step"], r1["seconds_per_step"]))
        row["accuracy"].append(list(r0["accuracy"].values())[-1])  # the last epoch
        row["bytes"].append(r0["gradient_bytes_per_step"])
        row["dense"].append(r0["dense_bytes_per_step"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--json", default=str(HERE / "results" / "compression.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_job(tmp, args)
    rows = summarise(ranks)
    sync_seconds = statistics.median(rows["sync"]["seconds"])
    print(f"\n2 workers, digits conv net (33.8k parameters), {args.optimizer}, {args.epochs} epochs, "
          f"global batch 64, seeds {args.seeds}, Gloo on loopback.\n")
    print("| config | ms/step (median) | vs sync | gradient bytes/step | fewer bytes than float32 | "
          "test accuracy (mean) | accuracy - sync |")
    print("|---|---|---|---|---|---|---|")
    sync_accuracy = statistics.mean(rows["sync"]["accuracy"])
    for config in CONFIGS:
        row = rows[config]
        seconds = statistics.median(row["seconds"])
        sent, dense = statistics.median(row["bytes"]), statistics.median(row["dense"])
        accuracy = statistics.mean(row["accuracy"])
        print(f"| {config} | {1000 * seconds:.1f} | {seconds / sync_seconds:.2f}x | {sent:,.0f} | "
              f"{dense / sent:.1f}x | {accuracy:.4f} | {100 * (accuracy - sync_accuracy):+.2f} pp |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
