"""Seconds per step of presets on loopback, side by side in the same two worker processes.

`tfdp bench` runs each preset in its own job; on this shared machine two jobs a minute apart
differ by 30% or more, which hides a 15% difference on a model as small as the digits conv net.
Here every preset trains the digits model in the same two processes, in alternating blocks of
one `fit` over the training split repeated 3 times (69 steps; the order rotating). A block's time
is the median time per step of the slower rank, and each preset's cost is the median over blocks
of its time over the baseline's in the same block.

    .venv/bin/python benchmarks/paired_presets.py [--presets sync fp16 ...] [--blocks 15] [--json F]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _launch import run_job

HERE = Path(__file__).resolve().parent
DEFAULT_PRESETS = ["sync", "fp16", "bf16", "qsgd", "topk-1pct", "efsign", "powersgd-r4"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS, help="the first is the baseline")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        print(f"running {len(args.presets)} presets x {args.blocks} blocks ...", file=sys.stderr, flush=True)
        ranks = run_job(HERE / "_paired_presets_worker.py", out,
                        ["--presets", *args.presets, "--blocks", args.blocks, "--batch-size", args.batch_size],
                        timeout=3600)
    seconds = {name: [max(per_rank) for per_rank in zip(*(r[name] for r in ranks))] for name in args.presets}
    base = seconds[args.presets[0]]
    print(f"\n2 workers on loopback, digits conv net (33,802 parameters, Adam), batch {args.batch_size} per "
          f"worker; {args.blocks} blocks of 3 passes over the training split per preset, alternating in the same processes.\n")
    print(f"| preset | ms/step (median) | vs {args.presets[0]} (median of per-block ratios) | range of ratios |")
    print("|---|---|---|---|")
    ratios = {}
    for name in args.presets:
        per_block = sorted(s / b for s, b in zip(seconds[name], base))
        ratios[name] = statistics.median(per_block)
        print(f"| {name} | {1000 * statistics.median(seconds[name]):.2f} | {ratios[name]:.3f}x | "
              f"{per_block[0]:.2f}-{per_block[-1]:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "seconds_per_step": seconds,
                                               "ratio_to_baseline": ratios}, indent=1))


if __name__ == "__main__":
    main()
