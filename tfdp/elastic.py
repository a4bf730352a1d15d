"""Public import path of elastic training: ``import tfdp.elastic`` (see `tfdp.keras.elastic`).

Kept out of ``import tfdp`` because it loads Horovod's elastic machinery.
"""

from tfdp.keras.elastic import CommitEvery, KerasState, run

__all__ = ["CommitEvery", "KerasState", "run"]
