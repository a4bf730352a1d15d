"""tfdp: data-parallel training for Keras 3 on TensorFlow, backed by Horovod.

Change the strategy line, launch with ``horovodrun -np N``::

    strategy = tfdp.MirroredStrategy()      # or tfdp.strategy("sync")
    with strategy.scope():
        model = build_and_compile_model()
    model.fit(x, y, batch_size=64)          # global batch

Layers, each importing only those below it: ``_compat`` (private TF/Keras/Horovod
access) → ``comm`` (collectives, counted) → ``compression`` (codecs) → ``reducers``
(what happens to gradients) → ``strategies`` (tf.distribute glue) → ``keras``
(optimizer wrapper, callbacks, elastic) → ``presets`` and ``tools`` (CLI, launcher,
benchmarks, advisor).
"""

from tfdp import compression
from tfdp.keras import DistributedOptimizer, callbacks
from tfdp.presets import preset_names, strategy
from tfdp.runtime import init, is_chief, local_rank, rank, replica_device, size
from tfdp.strategies import AsyncStrategy, CompressedStrategy, MirroredStrategy
from tfdp.strategies.output import restore_stdout, set_worker_stdout, worker_stdout

__version__ = "0.1.0"

__all__ = [
    "AsyncStrategy",
    "CompressedStrategy",
    "DistributedOptimizer",
    "MirroredStrategy",
    "callbacks",
    "compression",
    "init",
    "is_chief",
    "local_rank",
    "preset_names",
    "rank",
    "replica_device",
    "restore_stdout",
    "set_worker_stdout",
    "size",
    "strategy",
    "worker_stdout",
]

