"""Elastic digits training with tfdp.elastic.

    --die-rank R        rank R SIGKILLs itself in epoch 2 (first incarnation only)
    --grow-hosts-file F rank 0 adds the host of --grow-host to discovery file F in epoch 2
    --shard             MirroredStrategy(shard_optimizer_state=True); rank 0 also records the
                        largest difference between the optimizer state it committed last
                        before a reset and the one training resumes with

Rank 0 writes rank0.json to --out: test accuracy, final world size, resets, epochs run.
"""

import argparse
import os
import signal

from _common import write_result


import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402
import tfdp.elastic  # noqa: E402
from tfdp.tools.workloads import build_digits_model, load_digits_split  # noqa: E402

EPOCHS = 12


class DieInEpoch2(keras.callbacks.Callback):
    def __init__(self, state, rank):
        super().__init__()
        self.state, self.rank = state, rank

    def on_train_batch_begin(self, batch, logs=None):
        import horovod.tensorflow as hvd

        if self.state.resets == 0 and hvd.rank() == self.rank and self.epoch == 2 and batch == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


class GrowInEpoch2(keras.callbacks.Callback):
    def __init__(self, state, hosts_file, host):
        super().__init__()
        self.state, self.hosts_file, self.host = state, hosts_file, host

    def on_epoch_begin(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if epoch == 2 and hvd.rank() == 0 and self.state.resets == 0:
            with open(self.hosts_file, "a") as f:
                f.write(f"{self.host}:1\n")


class CompareRestore(keras.callbacks.Callback):
    """Rank 0: remember each commit's whole optimizer state; after a reset, compare the restored one."""

    committed = first_commit = None  # outlive the callback: `train` makes new ones after a reset
    restored_difference = first_commit_difference = None

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_begin(self, logs=None):
        if self.state.resets and CompareRestore.restored_difference is None:
            restored = self.state.optimizer_state()  # a collective: every rank calls it
            CompareRestore.restored_difference = _largest_difference(restored, CompareRestore.committed)
            # The control: the same comparison against an older commit must see a difference.
            CompareRestore.first_commit_difference = _largest_difference(restored, CompareRestore.first_commit)

    def on_train_batch_end(self, batch, logs=None):
        self.on_epoch_end(None)

    def on_epoch_end(self, epoch, logs=None):
        if self.state.resets == 0:
            CompareRestore.committed = [np.array(v) for v in self.state._saved[2]]
            CompareRestore.first_commit = CompareRestore.first_commit or CompareRestore.committed


def _largest_difference(values, others):
    assert [v.shape for v in values] == [o.shape for o in others]
    return max(float(np.max(np.abs(v - o))) for v, o in zip(values, others))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--die-rank", type=int)
    parser.add_argument("--grow-hosts-file")
    parser.add_argument("--grow-host", default="127.0.0.1")
    parser.add_argument("--shard", action="store_true")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    x_train, y_train, x_test, y_test = load_digits_split(0)
    strategy = (lambda: tfdp.MirroredStrategy(shard_optimizer_state=True)) if args.shard else None
    state = tfdp.elastic.KerasState(build_digits_model, strategy)

    @tfdp.elastic.run
    def train(state):
        callbacks = [tfdp.elastic.CommitEvery(state, batches=5)]
        if args.shard:
            callbacks.append(CompareRestore(state))  # after CommitEvery: sees each commit
        if args.die_rank is not None:
            callbacks.append(DieInEpoch2(state, args.die_rank))
        if args.grow_hosts_file:
            callbacks.append(GrowInEpoch2(state, args.grow_hosts_file, args.grow_host))
        state.model.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, initial_epoch=state.epoch,
                        verbose=0, callbacks=callbacks)

    train(state)
    _, accuracy = state.model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    import horovod.tensorflow as hvd

    if hvd.rank() == 0:
        write_result(args.out, {"accuracy": float(accuracy), "size": hvd.size(), "resets": state.resets,
                                "epoch": state.epoch, "sizes": state.sizes,
                                "restored_difference": CompareRestore.restored_difference,
                                "first_commit_difference": CompareRestore.first_commit_difference})


if __name__ == "__main__":
    main()
