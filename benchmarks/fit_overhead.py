"""The tfdp tax split in two: what every `fit` call costs once, and what every step costs.

The `make bench` MLP (784-512-512-10, global batch 64, 1 TF thread per worker) on 2 workers,
tfdp `fit` against Keras `fit` with a hand-written Horovod `train_step` ("horovod-fit"), in the
same two processes. Each round times, for both, one short fit (``--short`` steps) and one long
fit (``--long`` steps), in rotating order, both ranks starting each fit together. Per step: the
long fit's time over its steps. Per fit: the short fit's time less its steps at that rate.
Medians over the rounds, slower rank.

    .venv/bin/python benchmarks/fit_overhead.py [--rounds 8] [--short 5] [--long 200]
        [--also no-step-logs one-group]   # tfdp variants timed alongside
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: tfdp variants `--also` adds: name -> `tfdp.MirroredStrategy` options.
VARIANTS = {"no-step-logs": {"global_step_logs": False}, "one-group": {"bucket_bytes": None}}


def worker(args):
    sys.path.insert(0, str(HERE))
    import tensorflow as tf
    from _sync_worker import build_model, data, horovod_fit_model

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import horovod.tensorflow as hvd

    import tfdp

    tfdp.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = data(args.global_batch, args.long)
    fits = {}  # name: (model, inputs, batch size): tfdp gets the global arrays, horovod-fit its shard
    for name in ["tfdp", *args.also]:
        with tfdp.MirroredStrategy(**VARIANTS.get(name, {})).scope():
            fits[f"tfdp {name}" if name != "tfdp" else name] = (build_model(512, 2), x, y, args.global_batch)
    fits["horovod-fit"] = (horovod_fit_model(512, 2), x[rank::size], y[rank::size], args.global_batch // size)

    def fit(name, steps):
        model, xs, ys, batch = fits[name]
        # Start together: otherwise a fit's time holds the other rank's lag from the fit before.
        hvd.allreduce(tf.constant(0.0), name="fit_overhead_barrier")
        start = time.perf_counter()
        model.fit(xs[: batch * steps], ys[: batch * steps], batch_size=batch, verbose=0, shuffle=False)
        return time.perf_counter() - start

    for name in fits:
        fit(name, args.short)  # trace
    seconds = {name: {"short": [], "long": []} for name in fits}
    for round_ in range(args.rounds):
        shift = round_ % len(fits)
        order = list(fits)[shift:] + list(fits)[:shift]
        for name in order:
            seconds[name]["short"].append(fit(name, args.short))
            seconds[name]["long"].append(fit(name, args.long))
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(seconds))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--short", type=int, default=5, help="steps of the short fit")
    parser.add_argument("--long", type=int, default=200, help="steps of the long fit")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--also", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="tfdp variants to time alongside the default")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out:
        return worker(args)
    sys.path.insert(0, str(HERE))
    from _launch import run_job

    with tempfile.TemporaryDirectory() as out:
        ranks = run_job(Path(__file__), out, ["--rounds", args.rounds, "--short", args.short, "--long", args.long,
                                               "--global-batch", args.global_batch, "--also", *args.also],
                          timeout=3600)
    # Slower rank per fit.
    seconds = {name: {kind: [max(r[name][kind][i] for r in ranks) for i in range(args.rounds)]
                      for kind in ("short", "long")} for name in ranks[0]}
    per_step = {n: [s / args.long for s in v["long"]] for n, v in seconds.items()}
    per_fit = {n: [short - args.short * step for short, step in zip(v["short"], per_step[n])]
               for n, v in seconds.items()}
    print(f"2 workers, MLP 784-512-512-10, global batch {args.global_batch}; {args.rounds} rounds of a "
          f"{args.short}-step and a {args.long}-step fit each.\n")
    print("| | ms per step (long fits) | ms per fit, fixed (short fits) |\n|---|---|---|")
    for name in seconds:
        print(f"| {name} | {1e3 * statistics.median(per_step[name]):.2f} | "
              f"{1e3 * statistics.median(per_fit[name]):.0f} |")
    print()
    for name in (n for n in seconds if n != "horovod-fit"):
        ratio = statistics.median(b / a for a, b in zip(per_step[name], per_step["horovod-fit"]))
        extra = statistics.median(a - b for a, b in zip(per_fit[name], per_fit["horovod-fit"]))
        print(f"{name}: steps/s / horovod-fit's in long fits {ratio:.3f} (median of per-round ratios); "
              f"extra fixed cost per fit call {1e3 * extra:.0f} ms (median of per-round differences)")


if __name__ == "__main__":
    main()
