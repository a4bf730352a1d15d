"""tfdp: data-parallel training for Keras 3 on TensorFlow, backed by Horovod.

Change the strategy line, launch with ``horovodrun -np N``::

    strategy = tfdp.MirroredStrategy()      # or tfdp.strategy("sync")
    with strategy.scope():
        model = build_and_compile_model()
    model.fit(x, y, batch_size=64)          # global batch
"""

from tfdp import callbacks, compression
from tfdp.optimizer import DistributedOptimizer
from tfdp.presets import preset_names, strategy
from tfdp.runtime import init, is_chief, local_rank, rank, size
from tfdp.mirrored import MirroredStrategy
from tfdp.compressed import CompressedStrategy
from tfdp.asynchronous import AsyncStrategy

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
    "size",
    "strategy",
]
