"""Gradient reducers: what a worker does with its gradients before the optimizer update.

Every reducer implements the `GradientReducer` protocol; strategies and
`tfdp.DistributedOptimizer` speak only to it.
"""

from tfdp.reducers.allreduce import AllReduceGradients
from tfdp.reducers.base import GradientReducer, variable_key
from tfdp.reducers.compressed import DEFAULT_MIN_COMPRESS_BYTES, CompressedGradients, compressed_reducer_factory
from tfdp.reducers.delayed_averaging import DelayedAveraging
from tfdp.reducers.local_sgd import LocalSGD
from tfdp.reducers.stale import ExchangePipeline, StaleGradients
from tfdp.reducers.state import ReducerState, ReducerStateSaveable

__all__ = ["DEFAULT_MIN_COMPRESS_BYTES", "AllReduceGradients", "CompressedGradients", "DelayedAveraging", "ExchangePipeline",
           "GradientReducer", "LocalSGD", "ReducerState", "ReducerStateSaveable", "StaleGradients",
           "compressed_reducer_factory", "variable_key"]
