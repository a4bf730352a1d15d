"""Communication layer: collectives across workers, counted (Horovod, or an in-process fake)."""

from tfdp.comm.communicator import Communicator, HorovodCommunicator
from tfdp.comm.stats import CommunicationStats, float32_bytes, nbytes

__all__ = ["CommunicationStats", "Communicator", "HorovodCommunicator", "float32_bytes", "nbytes"]
