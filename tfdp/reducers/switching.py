"""`SwitchingReducer`: hands every protocol call to the reducer it runs now, and can hand over.

`tfdp.strategies.AutoStrategy` measures its first steps under the synchronous all-reduce,
then switches to the preset it picked. Both reducers keep their variables in one
`ReducerState`, with the index of the pick (``auto/choice``, -1 while undecided) first:
a checkpoint written after the switch holds the pick and the chosen reducer's state
(residuals, PowerSGD's Q, counters), and a job resumed from it switches before its first
step, so the chosen reducer's variables start from the loaded values.

Example:
    >>> reducer = SwitchingReducer(communicator, {"sync": sync_factory, "fp16": fp16_factory})
    >>> reducer.switch_to("fp16")   # on every rank, between steps
"""

import tensorflow as tf

from tfdp.reducers.base import GradientReducer
from tfdp.reducers.state import ReducerStateSaveable

UNDECIDED = -1


class SwitchingReducer(GradientReducer):
    """Delegate to one of several reducers; start with the first, switch by name.

    Args:
        communicator: a `tfdp.comm.Communicator`.
        factories: an ordered dict ``name -> (communicator, state) -> GradientReducer``; the
            first runs until `switch_to` names another.
    """

    def __init__(self, communicator, factories):
        super().__init__(communicator, op="sum")
        if not factories:
            raise ValueError("SwitchingReducer needs at least one reducer factory.")
        self.factories = dict(factories)
        self.names = list(self.factories)
        self.choice = self.state.variable("auto/choice", lambda: tf.constant(UNDECIDED, tf.int64))
        self.current_name = self.names[0]
        self.current = self.factories[self.current_name](communicator, self.state)

    @property
    def decided(self):
        """The name recorded as picked (in this run or in a loaded checkpoint), or None."""
        index = int(self.choice.numpy())
        return None if index == UNDECIDED else self.names[index]

    def switch_to(self, name):
        """Run the reducer `name` from the next traced step on; record it as the pick."""
        if name not in self.factories:
            raise ValueError(f"`name` must be one of {self.names}. Received: name={name!r}")
        self.choice.assign(self.names.index(name))
        if name != self.current_name:
            self.current_name = name
            self.current = self.factories[name](self.communicator, self.state)

    # -- the protocol, handed to the current reducer -----------------------------------
    def reduce(self, grads, variables, optimizer=None):
        return self.current.reduce(grads, variables, optimizer)

    def _reduce(self, grads, variables, opt):  # pragma: no cover - `reduce` is handed over whole
        raise NotImplementedError

    def saveable(self, optimizer):
        # One saveable for every reducer this may run (they share `state`); restoring per-rank
        # optimizer state is a no-op when none was saved.
        return ReducerStateSaveable(self.state, optimizer)

    def replaces_clipping(self, optimizer):
        return self.current.replaces_clipping(optimizer)

    def before_update(self, variables, optimizer=None):
        self.current.before_update(variables, optimizer)

    def after_update(self, variables, updated=None):
        self.current.after_update(variables, updated)

    def unsettled(self):
        return self.current.unsettled()

    def settle(self, apply_gradients, optimizer=None):
        self.current.settle(apply_gradients, optimizer)

    def stats(self):
        return self.current.stats()

    def memory_stats(self, optimizer):
        return self.current.memory_stats(optimizer)

    @property
    def sparse(self):
        return self.current.sparse

    @property
    def rounds_per_step(self):
        return self.current.rounds_per_step

    @property
    def supports_accumulation(self):
        return self.current.supports_accumulation

    @property
    def description(self):
        return f"{self.current.description} ({self.current_name}, picked by auto)"

    @property
    def optimizer_state_per_rank(self):
        return self.current.optimizer_state_per_rank

    @property
    def weights_rows(self):
        return self.current.weights_rows

    @property
    def shards_optimizer_state(self):
        return self.current.shards_optimizer_state

    @property
    def lockstep(self):
        return self.current.lockstep


__all__ = ["UNDECIDED", "SwitchingReducer"]
