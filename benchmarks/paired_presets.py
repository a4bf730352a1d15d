"""Seconds per step of presets side by side in the same worker processes, on loopback or emulated hosts.

`tfdp bench` runs each preset in its own job; on this shared machine two jobs a minute apart
differ by 30% or more, which hides a 15% difference on a model as small as the digits conv net.
Here every preset trains the same model in the same processes, in alternating blocks (the order
rotating): one `fit` over the digits training split repeated 3 times (69 steps), or `--steps`
steps of `tfdp bench`'s CNN or MLP (`--workload`). A block's time is the median time per step of
the slower rank, and each preset's cost is the median over blocks of its time over the
baseline's in the same block. With `--rate-mbit` (root) each worker runs in its own emulated host
linked at that rate. When `auto` is among the presets, the report names what it picked and its
time against the fastest other preset's, block by block.

    .venv/bin/python benchmarks/paired_presets.py [--presets sync fp16 ...] [--blocks 15] [--json F]
    .venv/bin/python benchmarks/paired_presets.py --workload cnn --batch-size 64 --rate-mbit 100 \
        --presets sync topk-1pct powersgd-r4 auto --blocks 7
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _launch import run_job

HERE = Path(__file__).resolve().parent
WORKLOADS = {"digits": "digits conv net (33,802 parameters, Adam)", "cnn": "CNN (315,722 parameters, SGD)",
             "mlp": "MLP 1024-h-h-10 of about {params:.3g} parameters, SGD"}
DEFAULT_PRESETS = ["sync", "fp16", "bf16", "qsgd", "topk-1pct", "efsign", "powersgd-r4"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS, help="the first is the baseline")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--workload", choices=["digits", "cnn", "mlp"], default="digits")
    parser.add_argument("--params", type=float, default=6e6, help="the MLP's parameters")
    parser.add_argument("--steps", type=int, default=20, help="cnn, mlp: steps per block")
    parser.add_argument("--rate-mbit", type=float, default=None, help="emulated hosts linked at this rate (root)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        print(f"running {len(args.presets)} presets x {args.blocks} blocks ...", file=sys.stderr, flush=True)
        ranks = run_job(HERE / "_paired_presets_worker.py", out,
                        ["--presets", *args.presets, "--blocks", args.blocks, "--batch-size", args.batch_size,
                         "--workload", args.workload, "--params", args.params, "--steps", args.steps],
                        timeout=3600, rate_mbit=args.rate_mbit)
    seconds = {name: [max(per_rank) for per_rank in zip(*(r["seconds"][name] for r in ranks))] for name in args.presets}
    picked = ranks[0]["picked"]
    base = seconds[args.presets[0]]
    link = f"emulated hosts at {args.rate_mbit:g} Mbit/s" if args.rate_mbit else "loopback"
    block = ("3 passes over the training split" if args.workload == "digits" else f"{args.steps} steps")
    print(f"\n{len(ranks)} workers on {link}, {WORKLOADS[args.workload].format(params=args.params)}, batch {args.batch_size} per worker; "
          f"{args.blocks} blocks of {block} per preset, alternating in the same processes.\n")
    print(f"| preset | ms/step (median) | vs {args.presets[0]} (median of per-block ratios) | range of ratios |")
    print("|---|---|---|---|")
    ratios = {}
    for name in args.presets:
        per_block = sorted(s / b for s, b in zip(seconds[name], base))
        ratios[name] = statistics.median(per_block)
        ran = f" (ran {picked[name]})" if name in picked else ""
        print(f"| {name}{ran} | {1000 * statistics.median(seconds[name]):.2f} | {ratios[name]:.3f}x | "
              f"{per_block[0]:.2f}-{per_block[-1]:.2f} |")
    report = {"args": vars(args), "seconds_per_step": seconds, "ratio_to_baseline": ratios, "picked": picked}
    if "auto" in seconds and len(seconds) > 1:
        report["auto_vs_fastest"] = auto_vs_fastest(seconds)
        print(f"\nauto / the fastest other preset in the same block: median {report['auto_vs_fastest']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


def auto_vs_fastest(seconds):
    """Median over blocks of auto's time over the fastest other preset's in the same block."""
    others = [s for name, s in seconds.items() if name != "auto"]
    return statistics.median(a / min(block) for a, block in zip(seconds["auto"], zip(*others)))

if __name__ == "__main__":
    main()
