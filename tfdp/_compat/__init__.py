"""Every access tfdp makes to non-public TensorFlow, Keras and Horovod code, one module per library.

`install()` puts tfdp's hooks into Keras (idempotent); see `tfdp._compat.keras`.
"""

from tfdp._compat.keras import install

__all__ = ["install"]
