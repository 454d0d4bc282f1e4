"""The paged KV cache: per layer one K and one V tensor
[num_blocks, block_size, kv_heads, head_dim], of the model's dtype or the one --kv-cache-dtype
names (bfloat16, fp8 E4M3 or E5M2: half or a quarter of float32's bytes, so the same memory holds
two or four times the tokens, and the CPU decode kernel reads less).

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


# --kv-cache-dtype's names (vLLM's) of the types a cache may hold besides the model's ("auto").
# "fp8" is E4M3, as in vLLM. There are no scales: values are rounded as they are (vLLM's
# default scale of 1.0), saturated at the type's largest finite value.
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# The name the Rust kernels (rust/kernels/src/kv_elem.rs) give each type they read, and the
# integer type whose numpy array carries its bits.
_KERNEL_TYPES = {torch.float32: ("float32", None), torch.bfloat16: ("bfloat16", torch.uint16),
                 torch.float8_e4m3fn: ("fp8_e4m3", torch.uint8), torch.float8_e5m2: ("fp8_e5m2", torch.uint8)}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of --kv-cache-dtype `name` ("auto": the model's)."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def kernel_kv_dtype(cache: torch.Tensor) -> str | None:
    """The kernels' name of what `cache` holds; None: a type they do not read."""
    kind = _KERNEL_TYPES.get(cache.dtype)
    return kind[0] if kind else None


def kernel_view(cache: torch.Tensor):
    """A CPU cache as the numpy array the Rust kernels take (no copy): float32 as it is, the
    narrow types as their bits."""
    bits = _KERNEL_TYPES[cache.dtype][1]
    return (cache if bits is None else cache.view(bits)).numpy()


def _fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def narrowed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype: an 8-bit float saturates at its largest finite value (torch's
    E5M2 cast would make an infinity; the Rust kernels' writes round the same way)."""
    if _fp8(dtype):
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def _copyable(t: torch.Tensor) -> torch.Tensor:
    # (torch has no index_copy_ for 8-bit floats on the CPU: their bytes are copied instead)
    return t.view(torch.uint8) if _fp8(t.dtype) else t


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v [T, kv_heads, head_dim] into the caches at slot_mapping [T] (int64), narrowed to the
    caches' dtype."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    _copyable(k_cache).view(-1, kvh, d).index_copy_(0, slot_mapping, _copyable(narrowed(k, k_cache.dtype)))
    _copyable(v_cache).view(-1, kvh, d).index_copy_(0, slot_mapping, _copyable(narrowed(v, v_cache.dtype)))


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
            cache = _copyable(cache)
            cache.index_copy_(0, dst, cache[src])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))
