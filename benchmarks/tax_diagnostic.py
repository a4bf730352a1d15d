"""Where tfdp's time goes inside `fit`: variants with parts of tfdp switched off, side by side.

The `make bench` MLP (784-512-512-10, global batch 64, 1 TF thread per worker) on 2 workers.
Every variant trains in the same two processes, in alternating timed blocks (the order rotates
each block), and the report is the median of per-block ratios against Keras `fit` with a
hand-written Horovod `train_step` (``horovod-fit``) and a bare Horovod loop. Variants are traced
with one part of tfdp removed: the step-logs all-reduce (``global_step_logs=False``), the
byte counters, or the whole gradient reducer (one `hvd.grouped_allreduce` instead).

    .venv/bin/python benchmarks/tax_diagnostic.py [--repeats 30] [--steps 40]
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = [("tfdp", {}, {}), ("no-logs", {"global_step_logs": False}, {}), ("no-counters", {}, {"counting": False}),
            ("direct-reducer", {}, {"direct": True}),
            ("direct-reducer-no-logs", {"global_step_logs": False}, {"direct": True})]


@contextlib.contextmanager
def switched_off(counting=True, direct=False):
    """While a variant's step is traced: no counters, or a bare grouped all-reduce as the reducer."""
    import tfdp.comm.stats as stats
    import tfdp.reducers.base as base

    saved = stats.CommunicationStats.add, stats.CommunicationStats.count_step, base.GradientReducer.reduce
    if not counting:
        stats.CommunicationStats.add = lambda self, name, amount: None
        stats.CommunicationStats.count_step = lambda self, grads: None
    if direct:
        import horovod.tensorflow as hvd

        base.GradientReducer.reduce = lambda self, grads, variables, optimizer=None: hvd.grouped_allreduce(
            list(grads), op=hvd.Sum)
    try:
        yield
    finally:
        stats.CommunicationStats.add, stats.CommunicationStats.count_step, base.GradientReducer.reduce = saved


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(HERE))
    import tensorflow as tf
    from _sync_worker import FitTrainer, LoopTrainer, build_model, data, horovod_fit_model, time_blocks

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import horovod.tensorflow as hvd

    import tfdp

    tfdp.init()
    x, y = data(args.global_batch, args.steps)
    trainers = {}
    for name, options, parts in VARIANTS:
        strategy = tfdp.MirroredStrategy(**options)
        with strategy.scope():
            model = build_model(512, 2)
        with switched_off(**parts):
            trainers[name] = FitTrainer(model, x, y, args.global_batch)
    rank, size = hvd.rank(), hvd.size()
    shard = x[rank::size], y[rank::size]
    trainers["horovod-fit"] = FitTrainer(horovod_fit_model(512, 2), *shard, args.global_batch // size)
    trainers["horovod-loop"] = LoopTrainer(build_model(512, 2), *shard, args.global_batch // size)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(time_blocks(trainers, args)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=40, help="steps per timed block")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out:
        return worker(args)
    from tfdp.tools.launcher import launch

    with tempfile.TemporaryDirectory() as out:
        run = launch([sys.executable, __file__, "--out", out, "--repeats", str(args.repeats), "--steps",
                      str(args.steps), "--global-batch", str(args.global_batch)], 2, use_horovodrun=True,
                     timeout=3600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, sink=None)
        if run.returncode:
            raise SystemExit(run.output[-4000:])
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    rates = {k: [min(a, b) for a, b in zip(ranks[0][k], ranks[1][k])] for k in ranks[0]}
    print("| variant | steps/s (median) | vs horovod-fit | vs horovod loop |\n|---|---|---|---|")
    for name, values in rates.items():
        fit = statistics.median(a / b for a, b in zip(values, rates["horovod-fit"]))
        loop = statistics.median(a / b for a, b in zip(values, rates["horovod-loop"]))
        print(f"| {name} | {statistics.median(values):.1f} | {fit:.3f} | {loop:.3f} |")


if __name__ == "__main__":
    main()
