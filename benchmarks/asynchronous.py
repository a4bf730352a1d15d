"""Overlap: time per step of bounded staleness versus synchronous exchange on a slow link.

The slow link is a documented artificial delay inside the exchange
(`AsyncStrategy(exchange_delay_seconds=...)`: the background thread sleeps before each
all-reduce). All variants run in the same two horovodrun workers, alternating in
rounds, and each round's numbers are the slower rank's. Printed per variant: median
ms/step, and the ratios that issue 4 asks about:

- compute time C: the step time with no delay minus its (waited-for) exchange time;
- communication time M: the measured time of one exchange on the slow link;
- synchronous exchange on the slow link should take about C + M;
- staleness 1 should take at most 1.2 x max(C, M).

    .venv/bin/python benchmarks/asynchronous.py [--rounds 5] [--delay 0.03]
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import _launch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_async_worker.py"
LABELS = {
    "mirrored": "tfdp.MirroredStrategy, no delay (graph all-reduce)",
    "compute-only": "AsyncStrategy(staleness=0), no delay",
    "sync-slow-link": "AsyncStrategy(staleness=0), slow link: synchronous",
    "s1-slow-link": "AsyncStrategy(staleness=1), slow link",
    "s2-slow-link": "AsyncStrategy(staleness=2), slow link",
}


def run_job(out, extra):
    return _launch.run_job(WORKER, out, extra, timeout=3600)


def per_round(ranks, name, field):
    """The slower rank's value in each round."""
    return [max(a, b) for a, b in zip(*(r["results"][name][field] for r in ranks))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--delay", type=float, default=0.05, help="seconds added to each exchange")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--json", default=str(HERE / "results" / "async.json"))
    args = parser.parse_args()
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "json"]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_job(tmp, extra)

    step = {name: per_round(ranks, name, "seconds") for name in LABELS}
    compute = [s - e for s, e in zip(step["compute-only"], per_round(ranks, "compute-only", "exchange"))]
    link = per_round(ranks, "sync-slow-link", "exchange")
    params = 784 * args.width + args.width * args.width + args.width * 10 + 2 * args.width + 10
    print(f"\n2 workers, MLP 784-{args.width}-{args.width}-10 ({params:,} parameters), global batch "
          f"{args.global_batch}, {args.rounds} rounds of {args.steps} steps, delay {1000 * args.delay:.0f} ms "
          "per exchange.\n")
    print(f"compute C = {1000 * statistics.median(compute):.1f} ms/step, "
          f"communication M = {1000 * statistics.median(link):.1f} ms/exchange\n")
    print("| variant | ms/step (median) | / (C + M) | / max(C, M) |")
    print("|---|---|---|---|")
    for name, label in LABELS.items():
        total = [s / (c + m) for s, c, m in zip(step[name], compute, link)]
        overlap = [s / max(c, m) for s, c, m in zip(step[name], compute, link)]
        print(f"| {label} | {1000 * statistics.median(step[name]):.1f} | "
              f"{statistics.median(total):.2f} | {statistics.median(overlap):.2f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
