"""Keras extras: `DistributedOptimizer` for custom loops, Horovod-style callbacks, elastic training.

`tfdp.keras.elastic` imports Horovod's elastic machinery; import it when you use it.
"""

from tfdp.keras import callbacks
from tfdp.keras.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "callbacks"]
