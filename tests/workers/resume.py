"""Train digits under a preset with keras.callbacks.BackupAndRestore; optionally SIGKILL rank 1.

    --preset NAME          the shipped preset (sync, topk-1pct, powersgd-r4, async-s1, ...)
    --optimizer NAME       sgd (momentum 0.9, the default), adam, or multi (a MultiOptimizer: Adam for
                           the conv layer, momentum SGD for the rest)
    --die-at-epoch K       rank 1 kills itself during epoch K (after rank 0 saved epoch K - 1)
    --forget-epoch         before fit, delete the saved epoch number (negative control: the
                           weights are restored but training restarts at epoch 0)
    --drop-reducer-state   negative control: the reducer state is lost. Checkpoints are written
                           without settling it (stale gradients in flight stay in flight) and,
                           after the restore, what was loaded is reset to its initial value.
    --reset-optimizer-slots
                           negative control: after the restore, the optimizer's slots (momentum,
                           Adam's moments: every variable that is not a scalar) are zeroed.

Rank 0 writes rank0.json to --out: the final weights and the epochs this run trained.
"""

import argparse
import os
import signal

from _common import rank, weights_as_lists, write_result

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp.tools.workloads import build_digits_model, load_digits_split  # noqa: E402

EPOCHS = 6


class DieInEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_begin(self, batch, logs=None):
        # Batch 2 of the epoch: rank 0 has finished the previous epoch's save by then,
        # since batches 0 and 1 needed its all-reduces.
        if self.current == self.epoch and batch == 2 and rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class ResetReducerState(keras.callbacks.Callback):
    """After BackupAndRestore has loaded the checkpoint, forget the reducer state it held."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def on_train_begin(self, logs=None):
        self.strategy.gradient_reducer.state.reset()


class ResetOptimizerSlots(keras.callbacks.Callback):
    """After BackupAndRestore has loaded the checkpoint, zero the optimizer's slots."""

    def on_train_begin(self, logs=None):
        for variable in self.model.optimizer.variables:
            if len(variable.shape):
                variable.assign(keras.ops.zeros_like(variable))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup", required=True)
    parser.add_argument("--preset", default="sync")
    parser.add_argument("--optimizer", choices=["sgd", "adam", "multi"], default="sgd")
    parser.add_argument("--die-at-epoch", type=int)
    parser.add_argument("--forget-epoch", action="store_true")
    parser.add_argument("--drop-reducer-state", action="store_true")
    parser.add_argument("--reset-optimizer-slots", action="store_true")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    x_train, y_train, _, _ = load_digits_split(0)
    strategy = tfdp.strategy(args.preset)
    with strategy.scope():
        if args.optimizer == "adam":
            optimizer = keras.optimizers.Adam(2e-3)
        elif args.optimizer == "multi":
            adam, momentum_sgd = keras.optimizers.Adam(2e-3), keras.optimizers.SGD(0.05, momentum=0.9)
            optimizer = keras.optimizers.MultiOptimizer(lambda v: adam if "conv2d" in v.path else momentum_sgd)
        else:
            optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        model = build_digits_model(optimizer)
    if args.forget_epoch and rank() == 0:
        os.unlink(os.path.join(args.backup, "training_metadata.json"))
    callbacks = [keras.callbacks.BackupAndRestore(args.backup, delete_checkpoint=False)]
    if args.drop_reducer_state:
        strategy.settle = lambda optimizer: None
        callbacks.append(ResetReducerState(strategy))
    if args.reset_optimizer_slots:
        callbacks.append(ResetOptimizerSlots())
    if args.die_at_epoch is not None:
        callbacks.append(DieInEpoch(args.die_at_epoch))
    # shuffle=False: the batch order of an epoch must not depend on how many epochs this process ran.
    history = model.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=callbacks)
    if rank() == 0:
        write_result(args.out, {"weights": weights_as_lists(model), "epochs_trained": len(history.epoch),
                                "first_epoch": history.epoch[0] if history.epoch else None,
                                "iterations": int(model.optimizer.iterations.numpy()),
                                "state": strategy.gradient_reducer.state.keys()})


if __name__ == "__main__":
    main()
