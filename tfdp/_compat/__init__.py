"""Every access tfdp makes to non-public TensorFlow, Keras and Horovod code, one module per library.

`install()` puts tfdp's hooks into Keras (idempotent); see `tfdp._compat.keras`.
"""



def install():
    """Put tfdp's hooks into Keras (idempotent). Imported on call: `tfdp._compat.horovod`, which
    the launcher uses, must not pull in Keras and TensorFlow."""
    from tfdp._compat.keras import install as install_keras_hooks

    install_keras_hooks()


__all__ = ["install"]
