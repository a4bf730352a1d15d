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

import importlib
import importlib.util
from typing import TYPE_CHECKING

from tfdp._allocator import prefer_pooled_cpu_allocator

prefer_pooled_cpu_allocator()  # Before TensorFlow's first op, or it has no effect.

# Names resolve on first use (PEP 562), so `tfdp run`, `tfdp timeline` and the launcher start
# without importing TensorFlow (about 5 s of CPU per process on these machines).
_HOMES = {
    "AsyncStrategy": "tfdp.strategies",
    "AutoStrategy": "tfdp.auto",
    "CompressedStrategy": "tfdp.strategies",
    "MirroredStrategy": "tfdp.strategies",
    "DistributedOptimizer": "tfdp.keras",
    "callbacks": "tfdp.keras",
    "preset_names": "tfdp.presets",
    "strategy": "tfdp.presets",
    "init": "tfdp.runtime",
    "is_chief": "tfdp.runtime",
    "local_rank": "tfdp.runtime",
    "rank": "tfdp.runtime",
    "replica_device": "tfdp.runtime",
    "size": "tfdp.runtime",
    "restore_stdout": "tfdp.strategies.output",
    "set_worker_stdout": "tfdp.strategies.output",
    "worker_stdout": "tfdp.strategies.output",
}

if TYPE_CHECKING:
    from tfdp import compression
    from tfdp.auto import AutoStrategy
    from tfdp.keras import DistributedOptimizer, callbacks
    from tfdp.presets import preset_names, strategy
    from tfdp.runtime import init, is_chief, local_rank, rank, replica_device, size
    from tfdp.strategies import AsyncStrategy, CompressedStrategy, MirroredStrategy
    from tfdp.strategies.output import restore_stdout, set_worker_stdout, worker_stdout


def __getattr__(name):
    if name not in _HOMES:
        if importlib.util.find_spec(f"tfdp.{name}") is not None:  # a subpackage: tfdp.presets, tfdp.tools, ...
            return importlib.import_module(f"tfdp.{name}")
        raise AttributeError(f"module 'tfdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "AsyncStrategy",
    "AutoStrategy",
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

