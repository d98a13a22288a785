"""Which data-parallel replica serves a request: least loaded, unless a replica already holds
the prompt's prefix in its KV cache and is not overloaded.

Pure and cheap (no torch, no I/O): the router (engine/replicas.py) builds one ``ReplicaView`` per
replica from figures that cost O(1) to read, and ``choose_replica`` decides. The decision is per
request, so its cost is compared with a model step in loadtest/PERF.md (well under 1 %).

Load = waiting + running requests, then KV-cache usage as the tie-break. A replica is
*overloaded* when it holds ``max_imbalance`` or more requests beyond the least loaded live
replica, or its KV usage is ``kv_imbalance`` above that replica's: prefix affinity must not pile
every request sharing a system prompt onto one replica while the other idles. Once the busy
replica is overloaded, the next request goes to the least loaded one, which computes the prefix
too; from then on both hold it and load decides between them.

Prefix hits are counted in whole KV blocks over the same sha256 chain the block manager uses
(engine/kv_blocks.py), so a hit here is a hit there: ``PrefixIndex`` walks a prompt's chain
(up to ``max_blocks`` blocks: the cost stays bounded for long prompts) and asks each replica's
block manager, and its own record of recently routed prompts (requests routed but whose blocks
are not computed yet, e.g. a burst sharing one system prompt), how many leading blocks it holds.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedserve.engine.kv_blocks import first_block_key, hash_block

DEFAULT_MAX_IMBALANCE = 4  # requests beyond the least loaded replica before affinity yields
DEFAULT_KV_IMBALANCE = 0.25  # KV usage beyond the least loaded replica before affinity yields
DEFAULT_MAX_PREFIX_BLOCKS = 32  # prefix blocks hashed per request (512 tokens at block size 16)
DEFAULT_RECORD_SIZE = 1 << 16  # routed prefix blocks remembered (LRU)


@dataclass(slots=True)
class ReplicaView:
    """What the router sees of one replica when it decides."""
    index: int
    alive: bool  # accepting requests (not dead, not restarting its workers)
    num_requests: int  # waiting + running
    kv_usage: float  # fraction of KV blocks held (0-1)
    prefix_blocks: int = 0  # leading blocks of this prompt it holds (cached or being computed)


def least_loaded(views: Sequence[ReplicaView]) -> ReplicaView | None:
    best = None
    for v in views:
        if v.alive and (best is None or (v.num_requests, v.kv_usage) < (best.num_requests, best.kv_usage)):
            best = v
    return best


def choose_replica(views: Sequence[ReplicaView], max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                   kv_imbalance: float = DEFAULT_KV_IMBALANCE) -> ReplicaView | None:
    """The live replica with the longest prefix hit among those not overloaded; the least loaded
    one when no such replica holds any of the prefix. None when no replica is alive."""
    least = least_loaded(views)
    if least is None:
        return None
    best = least
    for v in views:
        if not v.alive or v.prefix_blocks <= best.prefix_blocks:
            continue
        if (v.num_requests - least.num_requests >= max_imbalance
                or v.kv_usage - least.kv_usage >= kv_imbalance):
            continue  # overloaded: its cache is not worth the queue
        best = v
    return best


class PrefixIndex:
    """Prompt prefix → replicas that hold it, in KV blocks.

    ``cached(replica, block_hash)`` asks a replica's block manager; the index's own LRU record
    (block hash → replica last sent a prompt with it) covers blocks still being computed."""

    def __init__(self, block_size: int, root_hash: bytes, num_replicas: int,
                 max_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS, record_size: int = DEFAULT_RECORD_SIZE):
        self.block_size = block_size
        self.root_hash = root_hash
        self.num_replicas = num_replicas
        self.max_blocks = max_blocks
        self.record_size = record_size
        self._record: OrderedDict[bytes, int] = OrderedDict()

    def block_hashes(self, prompt_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The chain of the prompt's full blocks a cache hit could cover (never the last token),
        at most ``max_blocks``: the block manager's own hashes."""
        B = self.block_size
        n = min((len(prompt_ids) - 1) // B, self.max_blocks)
        hashes: list[bytes] = []
        parent = self.root_hash
        for i in range(n):
            parent = hash_block(parent, prompt_ids[i * B:(i + 1) * B], first_block_key(cache_salt) if i == 0 else b"")
            hashes.append(parent)
        return hashes

    def hits(self, hashes: Sequence[bytes], cached: Callable[[int, bytes], bool],
             alive: Sequence[bool]) -> list[int]:
        """Leading blocks of ``hashes`` each replica holds (0 for replicas not alive)."""
        record = self._record
        out = [0] * self.num_replicas
        for r in range(self.num_replicas):
            if not alive[r]:
                continue
            n = 0
            for h in hashes:
                if record.get(h) != r and not cached(r, h):
                    break
                n += 1
            out[r] = n
        return out

    def routed(self, hashes: Sequence[bytes], replica: int) -> None:
        """Remember that ``replica`` now computes (and will cache) these blocks."""
        record = self._record
        for h in hashes:
            record[h] = replica
            record.move_to_end(h)
        while len(record) > self.record_size:
            record.popitem(last=False)

    def forget_replica(self, replica: int) -> None:
        """A replica lost its cache (died or restarted): drop what the record says it holds."""
        for h in [h for h, r in self._record.items() if r == replica]:
            del self._record[h]
