"""Keras extras: `DistributedOptimizer` for custom loops, Horovod-style callbacks, elastic training.

`tfdp.keras.elastic` (public path: ``import tfdp.elastic``) imports Horovod's elastic
machinery, so it is imported only when used.
"""

from tfdp.keras import callbacks
from tfdp.keras.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "callbacks"]
