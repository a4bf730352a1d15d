"""The `tf.distribute` strategies: glue to Keras and tf.distribute, input splitting, the watchdog."""

from tfdp.strategies.asynchronous import AsyncStrategy
from tfdp.strategies.base import HorovodStrategy
from tfdp.strategies.compressed import CompressedStrategy
from tfdp.strategies.mirrored import MirroredStrategy

__all__ = ["AsyncStrategy", "CompressedStrategy", "HorovodStrategy", "MirroredStrategy"]
