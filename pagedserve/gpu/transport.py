"""Which transport carries steps to the workers and replies back: decided here, and only here.

- ``shm`` (gpu/shm_ring.py): the shared-memory ring, a few tens of µs per round trip. Its
  publication (payload first, sequence number last) is correct only where the CPU keeps stores
  in order, i.e. x86; pure Python has no memory barriers to make it correct elsewhere.
- ``pipe`` (gpu/pipe_channel.py): one pipe per reader; the kernel orders everything, so it is
  correct on any CPU, at the cost of a few syscalls per message.

The default is ``shm`` on x86 and ``pipe`` on every other CPU (aarch64: Grace, Graviton).
--step-transport (ParallelConfig.step_transport) or ``PAGEDSERVE_STEP_TRANSPORT=shm|pipe``
overrides it (the tests run the pipe on x86); asking for
the ring on a weakly ordered CPU is refused with ``RingUnsupported``. The attaching side needs
no choice: the spec says what it is.
"""
from __future__ import annotations

import logging

from pagedserve.contracts import env
from pagedserve.contracts.config import ConfigError
from pagedserve.gpu.pipe_channel import PipeChannel, PipeSpec
from pagedserve.gpu.shm_ring import RingSpec, ShmRing, ring_is_safe_here

logger = logging.getLogger(__name__)

ENV_TRANSPORT = env.STEP_TRANSPORT.name
TRANSPORTS = ("shm", "pipe")

Channel = ShmRing | PipeChannel


class TransportError(ConfigError):
    """PAGEDSERVE_STEP_TRANSPORT (or a caller) names no transport."""


def pick_transport(chosen: str | None = None) -> str:
    """``shm`` or ``pipe``: the config's choice (--step-transport), else the environment's, else
    the ring where it is correct (x86)."""
    if chosen is None:
        try:
            chosen = env.STEP_TRANSPORT.get()
        except ConfigError as e:
            raise TransportError(str(e)) from None
    if not chosen:
        return "shm" if ring_is_safe_here() else "pipe"
    if chosen not in TRANSPORTS:
        raise TransportError(f"unknown transport {chosen!r}: use one of {', '.join(TRANSPORTS)}")
    return chosen


def create_channel(num_readers: int, num_slots: int, slot_size: int, *, role: int | str,
                   kind: str | None = None, **kwargs) -> Channel:
    """Create one channel end (the creator owns the channel); ``kind`` None = ``pick_transport()``."""
    if pick_transport(kind) == "shm":
        return ShmRing.create(num_readers, num_slots, slot_size, role=role, **kwargs)
    return PipeChannel.create(num_readers, num_slots, slot_size, role=role, **kwargs)


def attach_channel(spec: RingSpec | PipeSpec, role: int | str, **kwargs) -> Channel:
    """Attach to a channel another process created, whichever transport its spec describes."""
    if isinstance(spec, PipeSpec):
        return PipeChannel.attach(spec, role, **kwargs)
    return ShmRing.attach(spec, role, **kwargs)
