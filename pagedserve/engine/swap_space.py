"""Bookkeeping of the host swap pool (preemption by swapping, vLLM V0's CPU blocks).

A sequence preempted by swapping has the K/V of its computed tokens copied from its device blocks
to host blocks of this pool; it waits holding those host blocks and, when it is admitted again,
gets fresh device blocks and the copies go back. The copies themselves are done by the workers
before the forward of the step that carries them (StepInput ``blocks_to_swap_out`` /
``blocks_to_swap_in``); this class only decides which host block holds what and which copies the
next step must carry.

Host blocks are not shared and not prefix-cached: one swapped sequence owns its host blocks
outright. A host block read by a swap-in is not free again until the step carrying that swap-in
has been sent (``take_pending``): the workers run steps in order, so any later step's swap-out
into that block happens after the read. Swap-outs whose sequence is dropped before they were
sent are dropped too, so two pending copies never target one host block.
"""
from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"the swap pool cannot have {num_blocks} blocks")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: lowest id on top
        self.tables: dict[int, list[int]] = {}  # seq id -> host blocks, in table order
        self.num_computed: dict[int, int] = {}  # seq id -> tokens whose K/V the host blocks hold
        self._pending_out: list[tuple[int, int, int]] = []  # (device, host, seq id), not yet sent
        self._pending_in: list[tuple[int, int]] = []  # (host, device), not yet sent
        self._release_on_send: list[int] = []  # host blocks read by a pending swap-in
        self.num_swapped_out = 0  # sequences swapped out (cumulative)
        self.num_swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def swap_out(self, seq_id: int, device_blocks: list[int], num_computed: int) -> bool:
        """Record that ``device_blocks`` (holding ``num_computed`` tokens) go to host blocks.
        False (nothing changed) when the pool is too full: the caller recomputes instead."""
        if seq_id in self.tables:
            raise RuntimeError(f"sequence {seq_id} is already swapped out")
        if not device_blocks or not self.can_hold(len(device_blocks)):
            return False
        host = [self._free.pop() for _ in device_blocks]
        self.tables[seq_id] = host
        self.num_computed[seq_id] = num_computed
        self._pending_out.extend((d, h, seq_id) for d, h in zip(device_blocks, host))
        self.num_swapped_out += 1
        return True

    def swap_in(self, seq_id: int, device_blocks: list[int]) -> int:
        """Schedule the copy back of a swapped sequence into ``device_blocks`` (its new table's
        leading blocks); returns its number of computed tokens. Its host blocks are released
        once the step carrying the copies is sent."""
        host = self.tables.pop(seq_id)
        num_computed = self.num_computed.pop(seq_id)
        if len(device_blocks) < len(host):
            raise RuntimeError(f"sequence {seq_id}: {len(host)} host blocks into {len(device_blocks)} device blocks")
        self._pending_in.extend(zip(host, device_blocks))
        self._release_on_send.extend(host)
        self.num_swapped_in += 1
        return num_computed

    def free(self, seq_id: int) -> None:
        """Forget a swapped sequence (finished or aborted while swapped out)."""
        host = self.tables.pop(seq_id, None)
        self.num_computed.pop(seq_id, None)
        if host is None:
            return
        self._pending_out = [p for p in self._pending_out if p[2] != seq_id]
        self._free.extend(reversed(host))

    def take_pending(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the step being sent must carry: (swap-out (device, host) pairs, swap-in
        (host, device) pairs). Host blocks read by these swap-ins become free."""
        out = [(d, h) for d, h, _ in self._pending_out]
        swap_in = self._pending_in
        self._pending_out, self._pending_in = [], []
        self._free.extend(reversed(self._release_on_send))
        self._release_on_send = []
        return out, swap_in

    def requeue_out(self, pairs: list[tuple[int, int]]) -> None:
        """A step never reached the workers: its swap-outs of sequences still swapped are due
        again (ahead of any newer ones)."""
        owner = {h: seq_id for seq_id, host in self.tables.items() for h in host}
        again = [(d, h, owner[h]) for d, h in pairs if h in owner]
        self._pending_out = again + self._pending_out

    def check_invariants(self) -> None:
        held = [h for host in self.tables.values() for h in host]
        assert len(set(held)) == len(held), "a host block is held twice"
        pending = set(self._release_on_send)
        assert not pending & set(held), "a host block is both held and being read for a swap-in"
        assert not set(self._free) & (set(held) | pending), "a held host block is on the free list"
        assert len(set(self._free)) == len(self._free)
        assert len(self._free) + len(held) + len(pending) == self.num_blocks, "host blocks leaked"
        assert set(self.tables) == set(self.num_computed)
        for d, h, seq_id in self._pending_out:
            assert h in self.tables.get(seq_id, ()), f"pending swap-out into host block {h} not held by {seq_id}"
