"""`ShardedOptimizerState`: ZeRO stage 1 (with stage 2's reduced gradients): each worker keeps
the optimizer state of 1/P of the model.

Each step, on every worker (inside the Keras step, where the optimizer would update):

1. the gradients, weighted by rows like every tfdp exchange, are laid out as a
   ``[P, L + 1]`` matrix (row r holds the entries worker r owns, then the row count) and
   reduce-scattered: worker r receives the sum of row r alone. The summed gradient is never
   whole on any worker (what ZeRO stage 2 saves; the local gradients of the backward pass
   are whole, as Keras computes them);
2. clipping is computed over the whole model (``global_clipnorm``: one scalar all-reduce;
   ``clipnorm``: one all-reduce of each variable's squared norm);
3. the user's Keras optimizer updates this worker's *shards* (variables holding its
   entries of the weights, copied from the model at every step) and keeps slots for
   them alone;
4. the updated shards are all-gathered and written back into the model's variables.

A reduce-scatter plus an all-gather move what one all-reduce moves. Checkpoints stay whole:
`settle` (which tfdp runs on every rank before each checkpoint and at the end of `fit`)
gathers every slot, and the optimizer saves the layout a ``sync`` optimizer would save, so
the file loads in plain Keras and under any number of workers (each takes its entries).

Partitions (`ShardPlan`): ``"flat"`` cuts the concatenated entries into P equal ranges
(pieces of a variable become 1-D shards; exact for optimizers that update each entry on
its own: SGD, Adam, AdamW, RMSprop, ...), ``"variables"`` gives each worker whole
variables, largest first to the least-loaded worker (any optimizer, e.g. Lamb's
per-variable trust ratio; less even). ``"auto"`` picks flat for Keras's elementwise
optimizers and variables otherwise.
"""

import math
import warnings
import weakref
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from tfdp._compat.keras import build_recording_slots, exclude_from_weight_decay_like, template_optimizer
from tfdp._compat.tensorflow import assign_in_update_context, variables_local_to_this_rank
from tfdp.reducers.base import GradientReducer, rows_in_this_step, variable_bytes, variable_key
from tfdp.reducers.optimizer_view import view as optimizer_view

PARTITIONS = ("auto", "flat", "variables")
_NOT_WHOLE = (
    "tfdp: shard_optimizer_state shards the optimizer's own update, so it cannot hand whole reduced gradients "
    "to a tfdp.DistributedOptimizer or to custom code. Create the optimizer under strategy.scope() and let "
    "it apply the gradients, or use tfdp.MirroredStrategy() without shard_optimizer_state.")

# Keras optimizers whose update of an entry depends on that entry alone (plus scalars).
_ELEMENTWISE = (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.Adamax,
                keras.optimizers.Nadam, keras.optimizers.RMSprop, keras.optimizers.Adagrad,
                keras.optimizers.Adadelta, keras.optimizers.Lion, keras.optimizers.Ftrl)


def check_partition(partition):
    """Return `partition` if it is one of `PARTITIONS`, else raise a ValueError naming them."""
    if partition not in PARTITIONS:
        raise ValueError(f"`shard_optimizer_state` must be False, True or one of {PARTITIONS}. "
                         f"Received: {partition!r}")
    return partition


@dataclass(frozen=True)
class Piece:
    """Entries ``[start, stop)`` of variable `variable` (flattened), at `offset` in its worker's row."""

    variable: int
    start: int
    stop: int
    offset: int
    whole: bool

    @property
    def size(self):
        return self.stop - self.start


class ShardPlan:
    """Which entries of which variables each of `size` workers owns.

    Example:
        >>> plan = ShardPlan([(3, 2), (4,)], size=2, partition="flat")
        >>> [[(p.variable, p.start, p.stop) for p in rank] for rank in plan.pieces]
        [[(0, 0, 5)], [(0, 5, 6), (1, 0, 4)]]
        >>> plan.row_length
        5
    """

    def __init__(self, shapes, size, partition="flat"):
        if partition not in ("flat", "variables"):
            raise ValueError(f"ShardPlan partition must be 'flat' or 'variables'. Received: {partition!r}")
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.size, self.partition = size, partition
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        spans = self._flat_spans() if partition == "flat" else self._variable_spans()
        self.pieces = []
        for rank_spans in spans:
            pieces, offset = [], 0
            for variable, start, stop in rank_spans:
                pieces.append(Piece(variable, start, stop, offset, start == 0 and stop == self.sizes[variable]))
                offset += stop - start
            self.pieces.append(pieces)
        self.row_length = max(1, max(sum(p.size for p in pieces) for pieces in self.pieces))
        # Flat rows are consecutive ranges of the concatenated entries, padded at the end.
        self.contiguous = partition == "flat"
        positions = np.zeros(self.total, np.int64)  # each entry's place in the gathered [size * L] vector
        for rank, pieces in enumerate(self.pieces):
            for p in pieces:
                first = self.offsets[p.variable] + p.start
                positions[first:first + p.size] = rank * self.row_length + p.offset + np.arange(p.size)
        self.positions = positions

    def _flat_spans(self):
        length = max(1, -(-self.total // self.size))
        spans = []
        for rank in range(self.size):
            low, high = rank * length, min((rank + 1) * length, self.total)
            spans.append([(i, max(low, int(self.offsets[i])) - int(self.offsets[i]),
                           min(high, int(self.offsets[i + 1])) - int(self.offsets[i]))
                          for i in range(len(self.sizes))
                          if max(low, int(self.offsets[i])) < min(high, int(self.offsets[i + 1]))])
        return spans

    def _variable_spans(self):
        loads, owned = [0] * self.size, [[] for _ in range(self.size)]
        for i in sorted(range(len(self.sizes)), key=lambda i: (-self.sizes[i], i)):
            rank = loads.index(min(loads))
            owned[rank].append(i)
            loads[rank] += self.sizes[i]
        return [[(i, 0, self.sizes[i]) for i in sorted(mine)] for mine in owned]

    def rows(self, flat, extra):
        """The ``[size, L + 1]`` matrix to reduce-scatter: each worker's entries of `flat` (the
        concatenated gradients), zero padding, then `extra` (a scalar) in the last column."""
        length = self.row_length
        if self.contiguous:
            matrix = tf.reshape(tf.pad(flat, [[0, self.size * length - self.total]]), [self.size, length])
        else:
            index = np.full(self.size * length, self.total, np.int64)
            index[self.positions] = np.arange(self.total)
            padded = tf.concat([flat, tf.zeros([1], flat.dtype)], 0)
            matrix = tf.reshape(tf.gather(padded, index), [self.size, length])
        column = tf.fill([self.size, 1], tf.cast(extra, flat.dtype))
        return tf.concat([matrix, column], 1)

    def entries(self, gathered):
        """The concatenated entries, in variable order, from the all-gathered ``[size * L]`` rows."""
        if self.contiguous:
            return gathered[: self.total]
        return tf.gather(gathered, self.positions)


@dataclass
class _Shards:
    """One optimizer's shards: its plan, this rank's shard variables and the saved layout."""

    plan: ShardPlan
    model_variables: list
    pieces: list  # this rank's Pieces
    shards: list  # one variable per piece
    slots: dict  # (piece index, slot name) -> optimizer variable
    globals: list  # the optimizer's other variables (iterations, learning rate), in order
    layout: list  # per variable a sync optimizer saves: ("global", k) or ("slot", variable index, name)
    layout_shapes: list
    layout_bytes: int
    snapshot: tuple = None  # (iterations, [values in layout order]) from the last settle or load


class ShardedOptimizerState(GradientReducer):
    """Shard the optimizer state (and the reduced gradients) across workers: ZeRO stage 1.

    The strategy's optimizers are built on this worker's shards; `apply_sharded` runs the
    step described in the module docstring. Under a `LossScaleOptimizer` (mixed_float16) the
    inner optimizer is sharded and the finiteness check is one decision for all workers
    (`all_finite`). Not with gradient accumulation.

    Example:
        >>> strategy = tfdp.MirroredStrategy(shard_optimizer_state=True)
        >>> with strategy.scope():
        ...     model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        >>> model.fit(x, y, batch_size=64)
        >>> strategy.memory_stats(model.optimizer)["optimizer_state_bytes"]
    """

    description = "sharded optimizer state (shard_optimizer_state)"
    supports_accumulation = False
    shards_optimizer_state = True
    rounds_per_step = 0  # counted in apply_sharded: a reduce-scatter and an all-gather

    def __init__(self, communicator, partition="auto"):
        super().__init__(communicator, op="sum")
        self.partition = check_partition(partition)
        self._by_optimizer = weakref.WeakKeyDictionary()

    # -- the parts of GradientReducer that do not apply ------------------------------
    def reduce(self, grads, variables, optimizer=None):
        raise ValueError(_NOT_WHOLE)

    @staticmethod
    def check_optimizer(optimizer):
        """Raise a ValueError for optimizers whose update cannot run on shards."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError("tfdp: a LossScaleOptimizer is not sharded itself; its inner optimizer is.")
        if isinstance(optimizer, keras.optimizers.MultiOptimizer):
            raise ValueError(
                "tfdp: shard_optimizer_state cannot shard a MultiOptimizer: its state lives in its "
                "sub-optimizers, each for its own variables. Use tfdp.MirroredStrategy() without "
                "shard_optimizer_state (preset sync), or one optimizer for every variable.")

    def all_finite(self, finite):
        """True on every rank when `finite` (this rank's verdict, a boolean tensor) is True on all."""
        nonfinite = tf.reshape(tf.cast(tf.logical_not(finite), tf.float32), [1])
        return tf.equal(self.communicator.allreduce([nonfinite], op="sum")[0][0], 0.0)

    def _reduce(self, grads, variables, opt):
        raise NotImplementedError  # `reduce` never gets here

    # -- building -------------------------------------------------------------------
    def _partition_for(self, optimizer):
        if self.partition != "auto":
            return self.partition
        return "flat" if type(optimizer) in _ELEMENTWISE else "variables"

    def build_sharded(self, optimizer, variables):
        """Build `optimizer` on this rank's shards of `variables` (the model's trainable variables)."""
        if optimizer.built:
            return
        dtypes = {v.dtype for v in variables}
        if len(dtypes) > 1:
            raise ValueError(f"tfdp: shard_optimizer_state needs trainable variables of one dtype; this "
                             f"model has {sorted(str(d) for d in dtypes)}. Use float32 variables "
                             "(mixed precision policies keep them float32).")
        plan = ShardPlan([v.shape for v in variables], self.communicator.size, self._partition_for(optimizer))
        pieces = plan.pieces[self.communicator.rank]
        with variables_local_to_this_rank():
            try:
                template = template_optimizer(optimizer)
            except Exception as error:  # noqa: BLE001 - any failure to rebuild it means it cannot be laid out
                raise ValueError(
                    f"tfdp: shard_optimizer_state lays out the state of a fresh {type(optimizer).__name__} made "
                    f"from its config, and making one failed ({type(error).__name__}: {error}). Use "
                    "tfdp.MirroredStrategy() without shard_optimizer_state (preset sync), or an optimizer "
                    "whose from_config(get_config()) works.") from error
            template_kinds = build_recording_slots(template, variables)
            layout_shapes = [tuple(v.shape) for v in template.variables]
            layout_bytes = sum(variable_bytes(v) for v in template.variables)
            del template
            shards = [keras.Variable(self._piece_value(variables[p.variable], p), name=variables[p.variable].name,
                                     dtype=variables[p.variable].dtype) for p in pieces]
            exclude_from_weight_decay_like(optimizer, [(variables[p.variable], s) for p, s in zip(pieces, shards)])
            kinds = build_recording_slots(optimizer, shards)
        slots = {kind: v for kind, v in zip(kinds, optimizer.variables) if kind is not None}
        my_globals = [v for kind, v in zip(kinds, optimizer.variables) if kind is None]
        layout, k = [], 0
        for kind in template_kinds:
            if kind is None:
                layout.append(("global", k))
                k += 1
            else:
                layout.append(("slot", *kind))
        if k != len(my_globals):
            raise ValueError(
                f"tfdp: shard_optimizer_state cannot shard {type(optimizer).__name__}: its state is not one "
                f"slot per variable entry ({k} other variables for the whole model, {len(my_globals)} for a "
                "shard). Use tfdp.MirroredStrategy() without shard_optimizer_state.")
        self._by_optimizer[optimizer] = _Shards(plan, list(variables), pieces, shards, slots, my_globals, layout,
                                                layout_shapes, layout_bytes)

    @staticmethod
    def _piece_value(variable, piece):
        if piece.whole:
            return tf.convert_to_tensor(variable)
        return tf.reshape(variable, [-1])[piece.start:piece.stop]

    def _shards_of(self, optimizer):
        shards = self._by_optimizer.get(_inner(optimizer))
        if shards is None:
            raise RuntimeError("tfdp: this optimizer is not built on shards yet; call it through fit, or "
                               "optimizer.build(model.trainable_variables) first.")
        return shards

    def model_variables(self, optimizer):
        """The model variables `optimizer` was built for (its shards are of these)."""
        return self._shards_of(optimizer).model_variables

    # -- one step -------------------------------------------------------------------
    def apply_sharded(self, optimizer, grads, variables, apply_to):
        """Reduce-scatter `grads`, update this rank's shards with ``apply_to(grads, shards)``,
        all-gather the shards into the model's `variables`."""
        s = self._shards_of(optimizer)
        plan, size = s.plan, self.communicator.size
        index = {variable_key(v): i for i, v in enumerate(s.model_variables)}
        full = [None] * len(s.model_variables)
        for g, v in zip(grads, variables):
            if variable_key(v) not in index:
                raise ValueError(f"tfdp: {variable_key(v)} is not among the variables this optimizer was built "
                                 "for; a sharded optimizer updates the model it was built with.")
            full[index[variable_key(v)]] = g
        self.communicator.stats.count_step(full, 2 if size > 1 else 0)
        _warn_if_duplicate_rows_change_the_update(full, optimizer)
        dtype = s.model_variables[0].dtype
        rows = rows_in_this_step() if size > 1 and self.weights_rows else None
        weight = tf.constant(1.0, dtype) if rows is None else tf.cast(rows, dtype)
        flat = tf.concat([tf.zeros([n], dtype) if g is None else tf.reshape(tf.convert_to_tensor(g), [-1]) * weight
                          for g, n in zip(full, plan.sizes)], 0)
        received = tf.reshape(self.communicator.reduce_scatter(plan.rows(flat, weight), gradients=True), [-1])
        mine = received[: plan.row_length]
        if rows is not None:
            mine = self.unweight(mine, received[plan.row_length])
        shard_grads = [None if full[p.variable] is None else
                       tf.reshape(mine[p.offset:p.offset + p.size], s.shards[j].shape)
                       for j, p in enumerate(s.pieces)]
        shard_grads = self._clip(shard_grads, s, optimizer)
        assign_in_update_context([(shard, self._piece_value(s.model_variables[p.variable], p))
                                  for p, shard in zip(s.pieces, s.shards)])
        if any(g is not None for g in shard_grads):
            apply_to(shard_grads, s.shards)
        else:  # nothing of this rank's shards has a gradient: still count the step, as the others do
            optimizer.iterations.assign_add(1)
        self._write_back(s, [i for i, g in enumerate(full) if g is not None])

    def overwrite_with_averages(self, optimizer):
        """`use_ema`: set the model's variables to the optimizer's moving averages. Each rank
        holds the averages of its own shards; they are all-gathered as the shards are after a step."""
        s = self._shards_of(optimizer)
        self._write_back(s, range(len(s.model_variables)), _inner(optimizer)._model_variables_moving_average)

    def _write_back(self, s, updated, sources=None):
        plan = s.plan
        used = sum(p.size for p in s.pieces)
        dtype = s.model_variables[0].dtype
        row = tf.concat([tf.reshape(shard, [-1]) for shard in (s.shards if sources is None else sources)] +
                        [tf.zeros([plan.row_length - used], dtype)], 0)
        entries = plan.entries(self.communicator.allgather_many([row])[0])
        pairs = []
        for i in updated:
            variable = s.model_variables[i]
            start = int(plan.offsets[i])
            value = tf.reshape(entries[start:start + plan.sizes[i]], variable.shape)
            constraint = getattr(variable, "constraint", None)
            pairs.append((variable, value if constraint is None else constraint(value)))
        assign_in_update_context(pairs)

    def _clip(self, grads, s, optimizer):
        """Keras's clipping (clipnorm, global_clipnorm, clipvalue) over whole variables and the whole model."""
        opt = optimizer_view(optimizer)
        present = [j for j, g in enumerate(grads) if g is not None]
        if opt.clipnorm:
            squares = tf.zeros([len(s.model_variables)], grads[present[0]].dtype) if present else None
            for j in present:
                squares = tf.tensor_scatter_nd_add(squares, [[s.pieces[j].variable]], [tf.reduce_sum(grads[j] ** 2)])
            if squares is None:
                squares = tf.zeros([len(s.model_variables)], s.model_variables[0].dtype)
            squares = self.communicator.allreduce([squares], op="sum")[0]
            clip = tf.cast(opt.clipnorm, squares.dtype)
            for j in present:  # keras/src/optimizers/base_optimizer.py `_clip_by_norm`, on the variable's norm
                total = squares[s.pieces[j].variable]
                norm = tf.where(total > 0, tf.sqrt(tf.where(total > 0, total, tf.ones_like(total))), total)
                grads[j] = grads[j] * clip / tf.maximum(norm, clip)
            return grads
        if opt.global_clipnorm:
            dtype = s.model_variables[0].dtype
            total = tf.add_n([tf.reduce_sum(grads[j] ** 2) for j in present]) if present else tf.zeros([], dtype)
            total = self.communicator.allreduce([tf.reshape(total, [1])], op="sum")[0][0]
            clip = tf.cast(opt.global_clipnorm, dtype)
            norm = tf.sqrt(total)  # `clip_by_global_norm`, on the whole model's norm
            scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
            return [None if g is None else g * scale for g in grads]
        clipvalue = getattr(optimizer, "clipvalue", None)
        if clipvalue:
            return [None if g is None else tf.clip_by_value(g, -clipvalue, clipvalue) for g in grads]
        return grads

    # -- checkpoints ----------------------------------------------------------------
    def settle(self, apply_gradients, optimizer=None):
        """Gather every slot onto every rank, in the layout a sync optimizer saves (a collective)."""
        optimizer = _inner(optimizer)
        s = self._by_optimizer.get(optimizer)
        if s is None:
            return
        names = list(dict.fromkeys(entry[2] for entry in s.layout if entry[0] == "slot"))
        rows = []
        for name in names:
            parts = [tf.reshape(s.slots[(j, name)], [-1]) for j in range(len(s.pieces)) if (j, name) in s.slots]
            used = sum(int(np.prod(p.shape)) for p in parts)
            dtype = parts[0].dtype if parts else s.model_variables[0].dtype
            rows.append(tf.concat(parts + [tf.zeros([s.plan.row_length - used], dtype)], 0))
        gathered = self.communicator.allgather_many(rows)
        whole = {name: s.plan.entries(g).numpy() for name, g in zip(names, gathered)}
        values = []
        for entry, shape in zip(s.layout, s.layout_shapes):
            if entry[0] == "global":
                values.append(s.globals[entry[1]].numpy())
            else:
                _, i, name = entry
                start = int(s.plan.offsets[i])
                values.append(whole[name][start:start + s.plan.sizes[i]].reshape(shape))
        s.snapshot = (int(optimizer.iterations.numpy()), values)

    def save_sharded(self, optimizer, store, save_plain):
        """Write `optimizer`'s whole state, as a sync optimizer would, from the last `settle`."""
        s = self._by_optimizer.get(optimizer)
        if s is None:
            return save_plain(store)
        if s.snapshot is None or s.snapshot[0] != int(optimizer.iterations.numpy()):
            raise RuntimeError(
                "tfdp: the optimizer state is sharded across workers and was not gathered since the last "
                "step. Call strategy.settle(model.optimizer) on every rank before saving by hand (tfdp's "
                "callbacks and the end of fit do).")
        for i, value in enumerate(s.snapshot[1]):
            store[str(i)] = value

    def load_sharded(self, optimizer, store, load_plain):
        """Load a whole (sync-layout) optimizer state: this rank takes its entries of every slot."""
        s = self._by_optimizer.get(optimizer)
        if s is None:
            return load_plain(store)
        if len(store.keys()) != len(s.layout):
            return load_plain(store)  # Keras's own warning: the saved optimizer does not match
        values = [np.asarray(store[str(k)]) for k in range(len(s.layout))]
        for (kind, *where), value in zip(s.layout, values):
            if kind == "global":
                s.globals[where[0]].assign(value)
                continue
            i, name = where
            for j, p in enumerate(s.pieces):
                if p.variable == i and (j, name) in s.slots:
                    s.slots[(j, name)].assign(value.reshape(-1)[p.start:p.stop].reshape(s.slots[(j, name)].shape))
        s.snapshot = (int(optimizer.iterations.numpy()), values)

    # -- reporting ------------------------------------------------------------------
    def memory_stats(self, optimizer):
        s = self._by_optimizer.get(_inner(optimizer))
        if s is None:
            return super().memory_stats(optimizer)
        # A LossScaleOptimizer's own scalars come on top, for sync as here.
        wrapper = sum(variable_bytes(v) for v in optimizer._variables) if optimizer is not _inner(optimizer) else 0
        return {
            "optimizer_state_bytes": sum(variable_bytes(v) for v in optimizer.variables),
            "sync_optimizer_state_bytes": s.layout_bytes + wrapper,
            "reduced_gradient_bytes": (s.plan.row_length + 1) * tf.as_dtype(s.model_variables[0].dtype).size,
            "sync_reduced_gradient_bytes": sum(variable_bytes(v) for v in s.model_variables),
            "shard_weight_bytes": sum(variable_bytes(v) for v in s.shards),
            "partition": s.plan.partition,
        }

    def stats(self):
        return {"max_staleness": 0}


def _warn_if_duplicate_rows_change_the_update(grads, optimizer):
    # Runs when the step is traced: once per fit, not per step.
    if any(isinstance(g, tf.IndexedSlices) for g in grads) and not optimizer_view(optimizer).linear_in_slices:
        warnings.warn(
            f"tfdp: shard_optimizer_state updates an embedding's gradient as a dense tensor, so rows a batch "
            f"repeats are summed before {type(_inner(optimizer)).__name__} sees them; Keras 3 on one process "
            "(and tfdp.MirroredStrategy) applies each repeated row on its own. The results differ for "
            "repeated rows; use tfdp.MirroredStrategy() where they must match one process.", stacklevel=2)


def _inner(optimizer):
    """The optimizer that holds the shards: a LossScaleOptimizer's inner optimizer, or `optimizer`."""
    return getattr(optimizer, "inner_optimizer", optimizer)


__all__ = ["PARTITIONS", "Piece", "ShardPlan", "ShardedOptimizerState", "check_partition"]
