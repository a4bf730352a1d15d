"""Ask TensorFlow for its pooled (BFC) CPU allocator, unless the user chose one.

TensorFlow's default CPU allocator is the C library's malloc, which returns every block above
its mmap threshold to the kernel when the block is freed. Each step of a large model frees and
allocates the same temporaries again (gradients, compressed payloads, residuals, the
optimizer's intermediates), and each comes back as fresh pages to fault in and zero. The BFC
allocator keeps them. On this project's 2-core machine (docs/results.md, "Pooled CPU
allocator"), ``a - b`` over 4 M floats took 12.1-13.5 ms with malloc and 2.5-3.0 ms pooled,
and a training step of the 6 M-parameter benchmark MLP took 36-41 ms instead of 39-56 ms, with
a lower peak RSS (720 MB against 830 MB).

TensorFlow reads ``TF_CPU_ALLOCATOR_USE_BFC`` once, when it allocates its first tensor, so
`prefer_pooled_cpu_allocator` runs when ``tfdp`` is imported: import it before TensorFlow runs
any op. ``TF_CPU_ALLOCATOR_USE_BFC=false`` in the environment keeps malloc.

Example:
    >>> import tfdp  # before any TensorFlow op
    >>> import tensorflow as tf
    >>> _ = tf.zeros([4])
    >>> pooled_cpu_allocator_in_use()
    True
"""

import os

POOLED_ALLOCATOR_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def prefer_pooled_cpu_allocator(environ=os.environ):
    """Set ``TF_CPU_ALLOCATOR_USE_BFC=true`` in `environ` unless it is already set."""
    environ.setdefault(POOLED_ALLOCATOR_ENV, "true")


def pooled_cpu_allocator_in_use():
    """True if this process's TensorFlow allocates CPU tensors with the BFC allocator.

    Only pooled allocators count what they hand out: after a tensor is made, `get_memory_info`
    on the CPU shows a peak above 0 (malloc raises, or on some machines reports 0 and 0).
    """
    import tensorflow as tf

    tf.zeros([1024]).numpy()  # something allocated, so a pooled allocator has a peak to report
    try:
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] > 0
    except ValueError:
        return False


__all__ = ["POOLED_ALLOCATOR_ENV", "pooled_cpu_allocator_in_use", "prefer_pooled_cpu_allocator"]
