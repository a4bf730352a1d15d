"""One worker of `tfdp bench`: train one workload with one preset and time its steps.

Started by `tfdp.tools.bench` through `tfdp.tools.launcher` (or alone for one worker). Rank 0 writes
one JSON object to ``--out``: per-step wall times of the timed steps, tfdp's payload bytes
over those steps and, on emulated hosts, the bytes that crossed this host's link
(``/sys/class/net/$HOROVOD_GLOO_IFACE/statistics/tx_bytes``) over the same steps.

    python -m tfdp.tools.bench_worker --preset sync --workload mlp --params 6e6 --out /tmp/r.json
    python -m tfdp.tools.bench_worker --preset sync --workload digits --target-accuracy 0.95 --out /tmp/d.json
"""

import argparse
import json
import os
import resource
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp.comm.timing import timed_calls  # noqa: E402
from tfdp.tools import workloads  # noqa: E402
from tfdp.tools.side_by_side import Rendezvous, alone  # noqa: E402
from tfdp.tools.slowdown import apply_from_env  # noqa: E402

WORKLOADS = ("mlp", "cnn", "digits")


class StepProbe(keras.callbacks.Callback):
    """Wall time, tfdp payload bytes and link bytes at the end of every batch; `meet` (a
    `tfdp.tools.side_by_side.Rendezvous`) is called before the first timed step, after
    `warmup_steps`."""

    def __init__(self, strategy, warmup_steps=0, meet=alone):
        super().__init__()
        self.strategy = strategy
        self.warmup_steps = warmup_steps
        self.meet = meet
        iface = os.environ.get("HOROVOD_GLOO_IFACE", "lo")
        # Loopback carries every worker's traffic: only an emulated host's link is its own.
        self.link_file = None if iface == "lo" else f"/sys/class/net/{iface}/statistics/tx_bytes"
        self.marks = []

    def _link_bytes(self):
        if self.link_file is None:
            return None
        with open(self.link_file) as f:
            return int(f.read())

    def _mark(self):
        stats = self.strategy.communication_stats() if hasattr(self.strategy, "communication_stats") else {}
        self.marks.append((time.perf_counter(), stats.get("payload_bytes", 0), self._link_bytes(),
                           stats.get("gradient_bytes", 0), time.process_time()))

    def on_train_batch_begin(self, batch, logs=None):
        if not self.marks:
            self._mark()

    def on_train_batch_end(self, batch, logs=None):
        if len(self.marks) == self.warmup_steps:  # this mark starts the timed steps
            self.meet("timed steps")
        self._mark()


OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(1e-3), "adam": lambda: keras.optimizers.Adam(1e-4)}


def build_synthetic(workload, params, optimizer="sgd"):
    """`tfdp bench`'s synthetic `workload` (``"mlp"`` of about `params` parameters, or ``"cnn"``),
    compiled with `optimizer` (a key of `OPTIMIZERS`)."""
    model = workloads.SYNTHETIC[workload](params)
    model.compile(optimizer=OPTIMIZERS[optimizer](), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _train_synthetic(strategy, workload, params, batch_size, total_steps, probe, optimizer="sgd", meet=alone):
    with strategy.scope():
        model = build_synthetic(workload, params, optimizer)
    # `batch_size` is per worker, so every job does the same work per worker and step.
    global_batch = batch_size * strategy.num_replicas_in_sync
    x, y = workloads.synthetic_data(model, total_steps * global_batch)
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[probe])
    return model, {"forward_seconds": forward_seconds(model, x[:batch_size], y[:batch_size], meet=meet)}


def forward_seconds(model, x, y, repeats=10, meet=alone):
    """Median seconds of the forward pass and loss on one worker's batch, traced as `fit` traces
    its step: what a step computes before backprop, so the rest of C is backprop and update."""
    import tensorflow as tf

    @tf.function(jit_compile=False)
    def forward(x, y):
        return model.compute_loss(x=x, y=y, y_pred=model(x, training=True))

    return statistics.median(timed_calls(lambda: forward(x, y).numpy(), repeats, ready=lambda: meet("forward")))


class EpochClock(keras.callbacks.Callback):
    """Seconds since the start of `fit` and validation accuracy at the end of every epoch."""

    def on_train_begin(self, logs=None):
        self.start, self.epochs = time.perf_counter(), []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((time.perf_counter() - self.start, float(logs["val_accuracy"])))


def _train_digits(strategy, batch_size, probe, target_accuracy, epochs):
    x_train, y_train, x_test, y_test = workloads.load_digits_split(0)
    with strategy.scope():
        model = workloads.build_digits_model()
    clock = EpochClock()
    model.fit(x_train, y_train, batch_size=batch_size * strategy.num_replicas_in_sync, epochs=epochs, verbose=0,
              validation_data=(x_test, y_test), callbacks=[probe, clock])
    reached = [(seconds, epoch) for epoch, (seconds, accuracy) in enumerate(clock.epochs, 1)
               if accuracy >= target_accuracy]
    return model, {
        "target_accuracy": target_accuracy, "final_accuracy": clock.epochs[-1][1],
        "seconds_to_target": reached[0][0] if reached else None,
        "epochs_to_target": reached[0][1] if reached else None,
    }


def _collective_latency(strategy, repeats=9):
    """Seconds of one all-reduce of 4 bytes on this job's link (the advisor's latency per
    collective), measured on every rank after training; None for one worker."""
    communicator = getattr(getattr(strategy, "extended", None), "communicator", None)
    if communicator is None or communicator.size == 1:
        return None
    from tfdp.comm.timing import allreduce_seconds

    return allreduce_seconds(communicator, 1, repeats=repeats)


def settling_steps(strategy, preset):
    """Steps before `preset` (its `strategy`) runs in its steady state: its own dense warm-up steps,
    and auto's measured steps too."""
    if isinstance(strategy, tfdp.AutoStrategy):
        return strategy.settling_steps()
    return tfdp.presets.load_variant(preset)["options"].get("warmup_steps", 0)


def run(preset, workload, params, batch_size, steps, warmup_steps, target_accuracy=0.95, epochs=20,
        optimizer="sgd", meet=alone):
    """Train `workload` with preset `preset`; return the timing summary (a dict).

    Synthetic workloads time `steps` steps after `warmup_steps`; digits trains `epochs`
    epochs, times every step after `warmup_steps` and records when the test accuracy first
    reaches `target_accuracy`. `meet` starts the timed phases together with copies of this job
    run side by side (`tfdp.tools.side_by_side`).
    """
    slowdown = apply_from_env()  # before any work: the whole process computes FACTOR times slower
    strategy = tfdp.strategy(preset)
    warmup_steps += settling_steps(strategy, preset)
    keras.utils.set_random_seed(0)
    probe = StepProbe(strategy, warmup_steps, meet)
    if workload == "digits":
        model, extra = _train_digits(strategy, batch_size, probe, target_accuracy, epochs)
    else:
        model, extra = _train_synthetic(strategy, workload, params, batch_size, warmup_steps + steps, probe,
                                        optimizer, meet)
    latency = _collective_latency(strategy)
    timed = probe.marks[warmup_steps:]
    steps = len(timed) - 1
    seconds = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
    span = timed[-1][0] - timed[0][0]
    link = None if timed[0][2] is None else (timed[-1][2] - timed[0][2]) / steps
    return {
        "preset": preset, "workload": workload, "parameters": int(model.count_params()),
        "batch_size": batch_size, "steps": steps, "warmup_steps": warmup_steps,
        "step_seconds": seconds, "median_seconds": statistics.median(seconds),
        "seconds_per_step": span / steps,
        "cpu_seconds_per_step": (timed[-1][4] - timed[0][4]) / steps,
        "payload_bytes_per_step": (timed[-1][1] - timed[0][1]) / steps,
        "gradient_bytes_per_step": (timed[-1][3] - timed[0][3]) / steps,
        "link_bytes_per_step": link,
        "threads": int(os.environ.get("TF_NUM_INTRAOP_THREADS", "0")),
        "shapes": [list(v.shape) for v in model.trainable_variables],
        "slowdown": slowdown,
        "balance": strategy.balance_stats() if hasattr(strategy, "balance_stats") else None,
        "optimizer": optimizer if workload != "digits" else "adam",
        "memory": strategy.memory_stats(model.optimizer) if hasattr(strategy, "memory_stats") else None,
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "auto": strategy.auto_stats() if isinstance(strategy, tfdp.AutoStrategy) else None,
        "latency_seconds": latency,
        **extra,
    }


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", required=True)
    parser.add_argument("--workload", choices=WORKLOADS, default="mlp")
    parser.add_argument("--params", type=float, default=6e6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--target-accuracy", type=float, default=0.95)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--time-compressors", nargs="*", default=[],
                        help="after training, time these compressed presets' compression on the model's shapes")
    parser.add_argument("--side-by-side", nargs=2, metavar=("DIR", "COPIES"),
                        help="this job is one of COPIES run at once: start each timed phase with the others "
                             "(they meet through files in DIR)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    meet = alone if args.side_by_side is None else Rendezvous(args.side_by_side[0], int(args.side_by_side[1]))
    result = run(args.preset, args.workload, int(args.params), args.batch_size, args.steps, args.warmup_steps,
                 args.target_accuracy, args.epochs, args.optimizer, meet)
    if args.time_compressors:
        from tfdp.tools.codec_timing import compressor_step_seconds

        # As many steps as the training timed: a side-by-side baseline pairs them up by index.
        result["compressor_step_seconds"] = {
            name: compressor_step_seconds(name, [tuple(s) for s in result["shapes"]], repeats=max(5, args.steps),
                                          ready=lambda name=name: meet(f"compressor {name}"))
            for name in args.time_compressors}
        result["compressor_seconds"] = {name: statistics.median(seconds)
                                        for name, seconds in result["compressor_step_seconds"].items()}
    if int(os.environ.get("HOROVOD_RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
