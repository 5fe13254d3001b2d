"""KV storage: a preallocated pool of rows for running sequences, and the LRU prefix cache.

Pool layout: k and v are [layers, rows, kv_heads, max_context, head_dim], head-major so that a
decode step attends over `k[layer, :n, :, :len]` as a view, without a gather. Running sequences
occupy rows 0..n-1 (the scheduler keeps them compact), so a decode batch is always a prefix of
the pool.

Prefix cache: prompt KV [layers, 2, kv_heads, len, head_dim] and the last position's logits,
keyed by (slot, slot version, base version, prompt ids). A hit skips the prompt's forward
entirely: the KV is copied into the new row and the first token is sampled from the stored logits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

# (slot, slot version, base version, prompt)
PrefixKey = tuple[int | None, int, int, tuple[int, ...]]


class KVPool:
    def __init__(
        self,
        layers: int,
        rows: int,
        kv_heads: int,
        context: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = (layers, rows, kv_heads, context, head_dim)
        self.dtype, self.device = dtype, device
        self.k = self.v = torch.empty(0)  # released: no memory held (release_memory)
        self.allocate()

    def allocate(self) -> None:
        if not self.allocated:
            # zeros, not empty: masked-out positions still meet V in probs @ V, and 0 * NaN
            # garbage would poison the row
            self.k = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def free(self) -> None:
        self.k = self.v = torch.empty(0)

    @property
    def allocated(self) -> bool:
        return self.k.numel() > 0

    def store_prefill(
        self, rows: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write a prefill's keys/values [n, kv_heads, T, D] at positions 0..T-1 of `rows`."""
        t = k.shape[2]
        self.k[layer, rows, :, :t] = k
        self.v[layer, rows, :, :t] = v

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a row's first `length` positions (all layers) into another row."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def export(self, row: int, length: int) -> torch.Tensor:
        return torch.stack((self.k[:, row, :, :length], self.v[:, row, :, :length]), dim=1)

    def load(self, row: int, kv: torch.Tensor) -> None:
        length = kv.shape[3]
        self.k[:, row, :, :length] = kv[:, 0]
        self.v[:, row, :, :length] = kv[:, 1]


@dataclass
class PrefixEntry:
    kv: torch.Tensor  # [layers, 2, kv_heads, len, head_dim]
    logits: torch.Tensor  # [vocab] float32, at the prompt's last position


class PrefixCache:
    """LRU over whole prompts, bounded by entry count."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[PrefixKey, PrefixEntry] = OrderedDict()
        self.hits = 0

    def get(self, key: PrefixKey) -> PrefixEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return entry

    def put(self, key: PrefixKey, entry: PrefixEntry) -> None:
        if self.capacity <= 0:
            return
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def drop_slot(self, slot: int | None) -> None:
        for key in [k for k in self.entries if k[0] == slot]:
            del self.entries[key]

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)
