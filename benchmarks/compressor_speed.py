"""Each compressed preset's compute per step and per MB of gradient, on the tensors of a real model.

One process, one TensorFlow thread (as each `tfdp bench` worker runs), no communication:
`tfdp.tools.codec_timing` runs the preset's own reducer (compress, decompress, error
feedback) on a one-worker communicator, which is the compute a worker adds to its step. The
tensors are the gradients' shapes of the `tfdp bench` MLP (`--params`, default 6 M:
1024-h-h-10). Top-k runs three times in the same process: as it trains, with `tf.math.top_k`
over every entry (which the sampled threshold replaced), and with its local residual built from
dense tensors (the general path, which building from the entries replaced). Medians of
`--repeats` timed steps. Last, decompression's scatter of k x 2 entries into the largest
gradient, `tf.scatter_nd` against `tf.math.unsorted_segment_sum` (which replaced it), in
alternating calls.

    .venv/bin/python benchmarks/compressor_speed.py [--params 6e6] [--repeats 7]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # before tfdp's import starts TensorFlow
tf.config.threading.set_inter_op_parallelism_threads(1)

from tfdp.compression import codecs, selection  # noqa: E402
from tfdp.tools.codec_timing import compressor_seconds  # noqa: E402
from tfdp.tools.workloads import build_mlp  # noqa: E402

PRESETS = {
    "fp16": "fp16",
    "bf16": "bf16",
    "qsgd": "qsgd",
    "randomk 1% (no error feedback)": "fp16:compressor.name=randomk,compressor.ratio=0.01,error_feedback=false",
    "topk-1pct (sampled threshold)": "topk-1pct",
    "topk-1pct (top_k over all entries)": "topk-1pct",
    "topk-1pct (local residual from dense tensors)": "topk-1pct",
    "efsign": "efsign",
    "powersgd-r4": "powersgd-r4",
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=6e6)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    shapes = [tuple(v.shape) for v in build_mlp(args.params).trainable_variables]
    entries = sum(int(np.prod(s)) for s in shapes)
    megabytes = entries * 4 / 1e6
    rows = {}
    for label, preset in PRESETS.items():
        previous, exchange_entries = selection.SAMPLED_TOP_K_MIN_ENTRIES, codecs.TopK.exchange_entries
        if "over all" in label:
            selection.SAMPLED_TOP_K_MIN_ENTRIES = 1 << 62
        if "dense tensors" in label:
            codecs.TopK.exchange_entries = None  # the reducer then takes the general path
        try:
            rows[label] = 1000 * compressor_seconds(preset, shapes, repeats=args.repeats)
        finally:
            selection.SAMPLED_TOP_K_MIN_ENTRIES, codecs.TopK.exchange_entries = previous, exchange_entries
    print(f"MLP of {entries:,} parameters ({megabytes:.1f} MB of float32 gradients), one thread, "
          f"median of {args.repeats} steps\n")
    print("| preset | ms per step (compress, decompress, residual) | ms per MB |")
    print("|---|---|---|")
    for label, ms in rows.items():
        print(f"| {label} | {ms:.1f} | {ms / megabytes:.2f} |")
    sampled, exact = rows["topk-1pct (sampled threshold)"], rows["topk-1pct (top_k over all entries)"]
    print(f"\ntop-k with the sampled threshold: {exact / sampled:.2f}x faster than top_k over all entries")
    dense = rows["topk-1pct (local residual from dense tensors)"]
    print(f"top-k's local residual from its entries: {dense / sampled:.2f}x faster than from dense tensors")
    print(scatter_comparison(max(shapes, key=lambda s: int(np.prod(s))), args.repeats))


def scatter_comparison(shape, repeats):
    """Decompression's scatter of 2 workers' top-1% entries into `shape`: scatter_nd against
    unsorted_segment_sum, called alternately; the two must agree bit for bit."""
    n = int(np.prod(shape))
    rng = np.random.default_rng(0)
    indices = tf.constant(rng.integers(0, n, size=2 * n // 100), tf.int32)
    values = tf.constant(rng.normal(size=2 * n // 100), tf.float32)
    calls = {"scatter_nd": tf.function(lambda: tf.scatter_nd(indices[:, None], values, [n])),
             "unsorted_segment_sum": tf.function(lambda: tf.math.unsorted_segment_sum(values, indices, n))}
    np.testing.assert_array_equal(calls["scatter_nd"]().numpy(), calls["unsorted_segment_sum"]().numpy())
    seconds = {name: [] for name in calls}
    for _ in range(2 * repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call().numpy()
            seconds[name].append(time.perf_counter() - start)
    old, new = (statistics.median(seconds[name]) * 1000 for name in calls)
    return (f"scatter of {2 * n // 100:,} entries into {n:,}: scatter_nd {old:.1f} ms, unsorted_segment_sum "
            f"{new:.1f} ms ({old / new:.2f}x; the same sums bit for bit)")

if __name__ == "__main__":
    main()
