"""`ReducerState`: a reducer's variables, saved and restored with the Keras optimizer.

A reducer keeps state between steps: error-feedback residuals, PowerSGD's Q, step
counters, local-SGD anchors. `ReducerState` holds it as named variables (keyed by the
path of the model variable they belong to) and writes it into every Keras checkpoint of
the optimizer (`model.save`, `ModelCheckpoint`, `BackupAndRestore`): tfdp attaches a
`ReducerStateSaveable` to the optimizer, and Keras saves it with the optimizer's own
variables. A file saved this way still loads in plain Keras, which does not look for it.

Entries are saved with their names and in creation order; loading matches them by name,
and by position where names differ (Keras names differ across ranks when, say, rank 0
built an extra model first). Some entries differ per rank (``per_rank=True``: error-feedback residuals). Only
rank 0 writes checkpoints, so before one is written every rank hands its rows to all
(`snapshot`), and the checkpoint holds one row per rank. Loading takes this rank's row
when the number of workers is the same; otherwise every rank takes the mean of the saved
rows, which keeps their sum (what error feedback still owes) unchanged.

Example:
    >>> state = ReducerState(communicator)
    >>> residual = state.variable("dense/kernel/residual", lambda: tf.zeros([4, 2]), per_rank=True)
"""

import json
import warnings
import weakref
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from tfdp._compat.tensorflow import local_variable

_OPTIMIZER_PREFIX = "optimizer/"

_META = "tfdp_meta"


@dataclass
class _Entry:
    key: str
    variable: tf.Variable
    initial: object  # callable returning the initial value
    per_rank: bool


class ReducerState:
    """Named variables of one reducer, with checkpoint save/load across ranks."""

    def __init__(self, communicator):
        self.communicator = communicator
        self._entries = {}
        self._pending = []  # loaded (label, value) waiting for their entry, in saved order
        self._snapshot = None  # {key: [workers, ...] array} from the last `snapshot`
        self._captured = None  # weak reference to the optimizer `capture` last copied

    def variable(self, key, initial_value, per_rank=False):
        """Return the variable named `key`, creating it from `initial_value` (a callable) once.

        A value loaded from a checkpoint before the entry existed becomes its initial value
        (entries are often created while a step is traced; an assign there would run every step).
        """
        if key in self._entries:
            return self._entries[key].variable
        pending = self._loaded_value(key, len(self._entries))

        def start_value():
            value = tf.convert_to_tensor(initial_value())
            return value if pending is None else self._checked(key, value, pending)

        variable = local_variable(start_value, f"tfdp_{key.replace('/', '_')}")
        self._entries[key] = _Entry(key, variable, initial_value, per_rank)
        return variable

    def _loaded_value(self, key, index):
        """The loaded (label, value) for entry `key`: by name, else by creation position."""
        for pending in self._pending:
            if pending[0] == key:
                return pending
        if index < len(self._pending) and self._pending[index][0] not in self._entries:
            return self._pending[index]
        return None

    def capture(self, optimizer):
        """Copy `optimizer`'s variables into per-rank entries (for reducers where they differ by rank)."""
        if self._captured is not None and self._captured() is not optimizer:
            # The model was compiled again (layers frozen, say): the new optimizer's
            # variables replace the old one's, whose shapes they need not have.
            for key in [k for k in self._entries if k.startswith(_OPTIMIZER_PREFIX)]:
                del self._entries[key]
        self._captured = weakref.ref(optimizer)
        for index, variable in enumerate(optimizer.variables):
            self.variable(f"{_OPTIMIZER_PREFIX}{index}", lambda v=variable: tf.identity(v), per_rank=True).assign(variable)

    def restore(self, optimizer):
        """Give `optimizer`'s variables this rank's values loaded by `load` (after Keras loaded rank 0's)."""
        for index, variable in enumerate(optimizer.variables):
            key = f"{_OPTIMIZER_PREFIX}{index}"
            # By name only: a checkpoint without per-rank optimizer state (gradient compression,
            # say) must not hand its other entries to the optimizer by position.
            if key in self._entries or any(label == key for label, _ in self._pending):
                variable.assign(self.variable(key, lambda v=variable: tf.identity(v), per_rank=True))

    def __contains__(self, key):
        return key in self._entries

    def keys(self):
        """Entry names in creation order."""
        return list(self._entries)

    def reset(self):
        """Give every entry its initial value again (what a run without saved state starts from)."""
        for entry in self._entries.values():
            entry.variable.assign(entry.initial())
        self._pending = []
        self._snapshot = None

    def snapshot(self):
        """Gather every rank's per-rank entries, so that rank 0's next checkpoint holds all of them.

        A collective: call it on every rank at the same point (tfdp does, before each
        checkpoint its callbacks write).
        """
        per_rank = [e for e in self._entries.values() if e.per_rank]
        gathered = self.communicator.allgather_stacked([tf.convert_to_tensor(e.variable) for e in per_rank])
        self._snapshot = {e.key: np.asarray(g) for e, g in zip(per_rank, gathered)}

    def _saved_value(self, entry):
        mine = entry.variable.numpy()
        if not entry.per_rank:
            return mine, 1
        rows = None if self._snapshot is None else self._snapshot.get(entry.key)
        # A snapshot older than the current value would save another step's residuals.
        if rows is None or not np.array_equal(rows[self.communicator.rank], mine):
            rows = mine[None]
        return rows, rows.shape[0]

    def save(self, store):
        """Write every entry into a Keras weights store (`save_own_variables`)."""
        meta = []
        for index, entry in enumerate(self._entries.values()):
            value, workers = self._saved_value(entry)
            store[str(index)] = value
            meta.append({"key": entry.key, "per_rank": entry.per_rank, "workers": workers})
        store[_META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)

    def load(self, store):
        """Read entries back from a Keras weights store (`load_own_variables`).

        Entries not created yet receive their value when they are.
        """
        if _META not in store.keys():
            return  # A checkpoint written without tfdp, or before the reducer had state.
        meta = json.loads(bytes(np.asarray(store[_META])).decode())
        self._pending = [self._value_for_this_rank(np.asarray(store[str(i)]), m) for i, m in enumerate(meta)]
        for index, entry in enumerate(self._entries.values()):
            pending = self._loaded_value(entry.key, index)
            if pending is not None:
                self._assign(entry, pending)
        self._snapshot = None

    def _value_for_this_rank(self, value, meta):
        if not meta["per_rank"]:
            return meta["key"], value
        if meta["workers"] == self.communicator.size:
            return meta["key"], value[self.communicator.rank]
        return meta["key"], value.sum(axis=0) / self.communicator.size

    @staticmethod
    def _checked(key, current, pending):
        """The loaded value if it fits `current`'s shape, else `current` (with a warning)."""
        label, value = pending
        if tuple(value.shape) != tuple(current.shape):
            warnings.warn(f"tfdp: reducer state {label!r} in the checkpoint has shape {list(value.shape)}, "
                          f"but {key!r} here has {current.shape.as_list()}; it starts from its "
                          "initial value instead.", stacklevel=3)
            return current
        return tf.constant(value, dtype=current.dtype)

    def _assign(self, entry, pending):
        entry.variable.assign(self._checked(entry.key, tf.convert_to_tensor(entry.variable), pending))


class ReducerStateSaveable(keras.layers.Layer):
    """Carries a `ReducerState` into Keras checkpoints; tfdp attaches it to the optimizer.

    A `Layer` only because Keras saves `KerasSaveable` children of an optimizer by type;
    it has no weights of its own and is never called. With `optimizer` (reducers whose
    workers' optimizer states differ, such as local SGD), the optimizer's variables of every
    rank travel in the reducer state, and each rank gets its own back after Keras has loaded
    rank 0's (Keras loads an optimizer's own variables before its children).
    """

    def __init__(self, state, optimizer=None):
        super().__init__(name="tfdp_reducer_state", trainable=False)
        object.__setattr__(self, "_reducer_state", state)  # Not tracked by Keras.
        # A weak reference: Keras's saving walks attributes, and would walk from here back
        # into the optimizer (and from it to here) forever.
        object.__setattr__(self, "_per_rank_optimizer", None if optimizer is None else weakref.ref(optimizer))

    def save_own_variables(self, store):
        self._reducer_state.save(store)

    def load_own_variables(self, store):
        self._reducer_state.load(store)
        optimizer = None if self._per_rank_optimizer is None else self._per_rank_optimizer()
        if optimizer is not None and optimizer.built:
            self._reducer_state.restore(optimizer)
