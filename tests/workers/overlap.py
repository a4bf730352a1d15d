"""Train `tfdp bench`'s CNN for a few steps in buckets of sync's default size; Horovod's timeline
(``HOROVOD_TIMELINE``, set by the test) records when each bucket's all-reduce was submitted.

``--after-backprop`` (the test's negative control) makes every bucket wait for the last gradient:
the same buckets and collectives, submitted when backprop has ended."""

import argparse

from _common import write_result

import keras
import tensorflow as tf

import tfdp
from tfdp.reducers.allreduce import DEFAULT_BUCKET_BYTES, AllReduceGradients
from tfdp.tools import workloads

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--after-backprop", action="store_true")
args = parser.parse_args()

if args.after_backprop:
    bucketed = AllReduceGradients._reduce

    def after_backprop(self, grads, variables, opt):
        with tf.control_dependencies(grads):
            grads = [tf.identity(g) for g in grads]
        return bucketed(self, grads, variables, opt)

    AllReduceGradients._reduce = after_backprop

strategy = tfdp.MirroredStrategy(bucket_bytes=DEFAULT_BUCKET_BYTES)
with strategy.scope():
    model = workloads.build_cnn()
    model.compile(keras.optimizers.SGD(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = workloads.synthetic_data(model, args.steps * 64 * strategy.num_replicas_in_sync)
model.fit(x, y, batch_size=64 * strategy.num_replicas_in_sync, epochs=1, shuffle=False, verbose=0)
write_result(args.out, {"steps": args.steps})
