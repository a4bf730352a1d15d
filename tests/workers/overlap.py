"""Train `tfdp bench`'s CNN for a few steps in buckets of sync's default size (given, so that one
inter-op thread keeps them too: the test's negative control); Horovod's timeline
(``HOROVOD_TIMELINE``, set by the test) records when each bucket's all-reduce was submitted."""

import argparse

from _common import write_result

import keras

import tfdp
from tfdp.reducers.allreduce import DEFAULT_BUCKET_BYTES
from tfdp.tools import workloads

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

strategy = tfdp.MirroredStrategy(bucket_bytes=DEFAULT_BUCKET_BYTES)
with strategy.scope():
    model = workloads.build_cnn()
    model.compile(keras.optimizers.SGD(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = workloads.synthetic_data(model, args.steps * 64 * strategy.num_replicas_in_sync)
model.fit(x, y, batch_size=64 * strategy.num_replicas_in_sync, epochs=1, shuffle=False, verbose=0)
write_result(args.out, {"steps": args.steps})
