"""The paged KV cache: per layer one K and one V tensor
[num_blocks, block_size, kv_heads, head_dim].

A token's K/V lives at slot `block * block_size + offset` (the Plan's slot_mapping). Block 0 is
the scheduler's null block, used to pad block tables; it is never written by a real token.
Tensors start zeroed so that padded (masked) keys read finite values: a masked NaN would still
poison the attention output (0 * NaN = NaN).

On the CPU the whole cache is one anonymous memory mapping: the OS hands out zeroed pages on
first touch, so building a 2 GiB cache costs nothing up front (torch.zeros wrote every page,
1-3 s of each start on 2 cores) and blocks no request ever reaches never take memory.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor backed by an anonymous mmap (pages mapped lazily, on first touch)."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # private, as malloc'd memory is: a forked child gets copy-on-write pages, not shared ones
    buf = mmap.mmap(-1, max(numel * itemsize, 1), flags=mmap.MAP_PRIVATE)
    # the tensor keeps `buf` alive; the mapping goes when the last view of it does
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v [T, kv_heads, head_dim] into the caches at slot_mapping [T] (int64)."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class KVCache:
    """Per-layer (K, V) pairs; `cache[i]` is what layer i's attention receives."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        if torch.device(device).type == "cpu":
            both = zeroed_host_tensor((2, num_layers, *shape), dtype)
            self.key, self.value = list(both[0]), list(both[1])
        else:
            self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def __len__(self) -> int:
        return len(self.key)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key[layer], self.value[layer]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] (int64 [C]) in every layer (forked sequences)."""
        if src.numel() == 0:
            return
        for cache in (*self.key, *self.value):
            cache.index_copy_(0, dst, cache[src])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))
