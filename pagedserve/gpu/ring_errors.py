"""The errors of the step transports (ShmRing, PipeChannel), in their own module so that the
shared waiting code (gpu.transport_end) and both transports can raise them without importing
each other. gpu.shm_ring re-exports them: callers keep importing from there."""
from __future__ import annotations


class RingError(RuntimeError):
    """Base class of ring failures."""


class RingClosed(RingError):
    """The ring was closed (shut down) and holds no more messages."""


class RingPeerDied(RingError):
    """A process on the other side of the ring is gone."""


class RingTimeout(RingError, TimeoutError):
    """A send or receive did not complete in time."""


class RingUnsupported(RingError):
    """This CPU does not keep stores in order, which the ring's publication relies on."""
