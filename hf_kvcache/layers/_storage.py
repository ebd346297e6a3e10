"""Token-axis storage shared by the cache layers: growable buffers, a full-precision residual, and a shared
dequantization workspace.

All tensors are laid out ``(B, H, T, ...)``: batch, KV heads, tokens, then per-token payload. Capacity grows along
the token axis by a fraction of the current size, so an append costs amortized O(new tokens) and the slack is bounded
(``GROWTH``); ``nbytes`` counts the slots that hold live tokens, ``reserved_nbytes`` the whole allocation.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch

from ..formats._base import Parts
from ..kernels.append import append_kv

# Headroom added when a buffer grows: a fraction of the needed size, at least MIN_GROWTH_TOKENS tokens.
GROWTH = 0.125
MIN_GROWTH_TOKENS = 64


def _grown_capacity(needed: int, unit: int) -> int:
    """Tokens to allocate for ``needed``: with headroom, a multiple of ``unit`` and of 16, so that the buffers' batch
    and head strides keep the same divisibility as they grow (the Triton kernels compile once, not per capacity)."""
    cap = needed + max(MIN_GROWTH_TOKENS, int(needed * GROWTH))
    align = unit * 16 // math.gcd(unit, 16)
    return -(-cap // align) * align


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def saved_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a saved cache holds it (pickle, ``torch.save``): in host memory and storage of its own. torch.save
    writes a view's whole storage (a buffer's headroom, a window's evicted prompt); copies kept on the device would
    all be alive until the file is written, a cache's worth of device memory more (here one tensor at a time, the
    time of its copy to the host)."""
    return t.clone() if t.device.type == "cpu" else t.cpu()


# Where a cache being loaded (hf_kvcache.load_cache's map_location) sends the tensors saved from each device: None
# (each back to its own), a device (all there) or {saved device: device}, as torch.load reads its map_location.
_MAP_LOCATION: contextvars.ContextVar = contextvars.ContextVar("hf_kvcache_map_location", default=None)


@contextlib.contextmanager
def mapping_devices(map_location) -> Iterator[None]:
    """Loads inside send what was saved from a device where ``map_location`` says (:func:`loaded_device`)."""
    token = _MAP_LOCATION.set(map_location)
    try:
        yield
    finally:
        _MAP_LOCATION.reset(token)


def loaded_device(device: torch.device | str | None) -> torch.device | None:
    """The device a tensor saved from ``device`` goes to as a cache is loaded: ``device`` itself, or where the active
    :func:`mapping_devices` sends it."""
    if device is None:
        return None
    where = _MAP_LOCATION.get()
    if isinstance(where, dict):
        where = where.get(str(device), device)
    return torch.device(device if where is None else where)


class TokenBuffers:
    """Named tensors that share a token axis (dim 2), each with its own tokens-per-slot ``unit``.

    A key scale stored once per group of G tokens has unit G; packed codes have unit 1. The buffer holds the
    live tokens ``[start, start + length)`` of its allocation; appends, tail truncation and front drops move only
    bookkeeping, except for the occasional grow / compaction copy. ``shrink``: a buffer that drops tokens from the
    front (a sliding window) also moves to a right-sized allocation at an append once it holds more than twice what
    it needs (a long prompt's, evicted), instead of keeping the prompt's allocation for good.
    """

    def __init__(self, units: dict[str, int], shrink: bool = False):
        self.units = units
        self.shrink = shrink
        self.align = max(units.values())
        self.tensors: dict[str, torch.Tensor] = {}
        self.capacity = 0  # tokens
        self.start = 0  # tokens dropped from the front, not yet compacted
        self.length = 0  # live tokens

    def _check_aligned(self, n: int, what: str) -> None:
        if n % self.align:
            raise RuntimeError(f"{what} of {n} tokens is not a multiple of the storage unit {self.align}")

    def _slot(self, name: str, a: int, b: int) -> torch.Tensor:
        u = self.units[name]
        return self.tensors[name][:, :, a // u : b // u]

    def view(self, name: str) -> torch.Tensor:
        """Live part of tensor ``name``: ``(B, H, length / unit, ...)``."""
        return self._slot(name, self.start, self.start + self.length)

    def views(self) -> dict[str, torch.Tensor]:
        """Live parts of every tensor, by name (what a codec decodes)."""
        return {name: self.view(name) for name in self.tensors}

    def tail(self, name: str, n: int) -> torch.Tensor:
        """Last ``n`` live tokens of tensor ``name``."""
        end = self.start + self.length
        return self._slot(name, end - n, end)

    def _reallocate(self, capacity: int) -> None:
        new = {}
        for name, t in self.tensors.items():
            u = self.units[name]
            fresh = t.new_empty((t.shape[0], t.shape[1], capacity // u, *t.shape[3:]))
            fresh[:, :, : self.length // u].copy_(self.view(name))
            new[name] = fresh
        self.tensors, self.capacity, self.start = new, capacity, 0

    def append(self, chunk: dict[str, torch.Tensor]) -> None:
        """Append tensors whose token axis holds ``n`` tokens (``n / unit`` slots each)."""
        n = next(iter(chunk.values())).shape[2] * self.units[next(iter(chunk))]
        for name, slot in self.reserve(n, lambda: chunk).items():
            slot.copy_(chunk[name])
        self.length += n

    def append_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append full-precision keys and values ``(B, H, n, D)`` to buffers named ``"k"`` and ``"v"`` in one launch
        on CUDA (:func:`~hf_kvcache.kernels.ops.append_kv`; two copies otherwise)."""
        self.append_written(
            k.shape[2],
            lambda: {"k": k, "v": v},
            lambda out: append_kv(k, v, out["k"], out["v"], None, None, None, 0, 1, None, None),
        )

    def append_written(self, n: int, like: Callable[[], Parts], write: Callable[[Parts], None]) -> None:
        """Append ``n`` tokens that ``write`` stores itself into the slot views it is given (an encoder writing
        straight into the storage, no intermediate chunk). ``like``: see :meth:`reserve`."""
        write(self.reserve(n, like))
        self.length += n

    def reserve(self, n: int, like: Callable[[], Parts]) -> Parts:
        """Views of the slots of the next ``n`` tokens, by name (the buffer's units), allocating or growing as needed;
        they become live when the caller adds ``n`` to ``length``. ``like()``, called for the first allocation only:
        a tensor per name with the dtype, device and non-token dimensions of the stored one (any token length)."""
        self._check_aligned(n, "append")
        if not self.tensors:
            cap = _grown_capacity(n, self.align)
            self.tensors = {
                name: t.new_empty((t.shape[0], t.shape[1], cap // self.units[name], *t.shape[3:]))
                for name, t in like().items()
            }
            self.capacity = cap
        else:
            grown = _grown_capacity(self.length + n, self.align)
            oversized = self.shrink and self.capacity > 2 * grown
            if oversized or self.start + self.length + n > self.capacity:
                # Compact instead of growing when dropped front slots leave enough headroom (sliding layers); the
                # headroom keeps compactions amortized.
                self._reallocate(grown if oversized or grown > self.capacity else self.capacity)
        end = self.start + self.length
        return {name: self._slot(name, end, end + n) for name in self.tensors}

    def truncate(self, n: int) -> None:
        """Forget the last ``n`` tokens."""
        self._check_aligned(n, "truncate")
        if n > self.length:
            raise RuntimeError(f"cannot truncate {n} tokens from a buffer holding {self.length}")
        self.length -= n

    def drop_front(self, n: int) -> None:
        """Forget the first ``n`` tokens (their slots are reused at the next compaction)."""
        self._check_aligned(n, "drop_front")
        if n > self.length:
            raise RuntimeError(f"cannot drop {n} tokens from a buffer holding {self.length}")
        self.start += n
        self.length -= n

    def clear(self) -> None:
        """Forget every token, keeping the allocation."""
        self.start = self.length = 0

    def release(self) -> None:
        """Forget every token and free the allocation."""
        self.tensors, self.capacity = {}, 0
        self.clear()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every tensor by ``fn`` of its live part (a batch-axis operation: reorder, repeat, select)."""
        if not self.tensors:
            return
        self.tensors = {name: fn(self.view(name)).contiguous() for name in self.tensors}
        self.capacity, self.start = self.length, 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> None:
        self.tensors = {name: t.to(device, non_blocking=non_blocking) for name, t in self.tensors.items()}

    # -- saved and copied ---------------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Saved (pickle, torch.save), a buffer holds its live tokens only: a file the size of nbytes, not of the
        # allocation's headroom or of a long prompt's evicted front.
        state = self.__dict__.copy()
        state["tensors"] = {name: saved_tensor(self.view(name)) for name in self.tensors}
        state["device"] = next(iter(self.tensors.values())).device if self.tensors else None
        state["capacity"], state["start"] = self.length, 0
        return state

    def __setstate__(self, state: dict) -> None:
        live, device = state.pop("tensors"), loaded_device(state.pop("device"))
        self.__dict__.update(state)
        self.tensors, self.capacity = {}, 0
        if live:  # back on its device, with the headroom an append would have left
            self.capacity = _grown_capacity(self.length, self.align)
            for name, t in live.items():
                fresh = t.new_empty(
                    (t.shape[0], t.shape[1], self.capacity // self.units[name], *t.shape[3:]), device=device
                )
                fresh[:, :, : t.shape[2]].copy_(t)
                self.tensors[name] = fresh

    def __deepcopy__(self, memo: dict) -> TokenBuffers:
        # A copy (transformers' recipe for reusing a prompt's cache) keeps the allocation as it is, on its device:
        # one copy of each tensor, and the next appends land in the headroom, as the original's would.
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(self.__dict__)
        clone.units = dict(self.units)
        clone.tensors = {name: t.clone() for name, t in self.tensors.items()}
        return clone

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(self.view(name)) for name in self.tensors)

    @property
    def reserved_nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())


class Workspace:
    """Reused output buffers for the K/V a layer returns to attention.

    One buffer pair per (device, dtype, batch, heads, key and value widths), shared by all layers of a cache: a
    layer's K/V is
    consumed by its attention before the next layer writes, so one layer's worth of full-precision memory serves the
    whole model instead of a fresh allocation per layer per step. Not used when autograd records (a later layer would
    overwrite tensors saved for backward).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, H, length, Dk)`` and ``(B, H, length, Dv)`` tensors with the dtype and device of ``keys`` /
        ``values`` (the new tokens of a forward)."""
        b, h, _, dk = keys.shape
        dv = values.shape[-1]
        if torch.is_grad_enabled() and keys.requires_grad:
            return keys.new_empty((b, h, length, dk)), values.new_empty((b, h, length, dv))
        key = (keys.device, keys.dtype, b, h, dk, dv)
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].shape[2] < length:
            cap = _grown_capacity(length, 1)
            self._buffers[key] = bufs = (keys.new_empty((b, h, cap, dk)), values.new_empty((b, h, cap, dv)))
        return bufs[0][:, :, :length], bufs[1][:, :, :length]

    def clear(self) -> None:
        self._buffers.clear()

    def __getstate__(self) -> dict:
        return {"_buffers": {}}  # scratch: a saved cache takes a new one at its next forward

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(k) + _nbytes(v) for k, v in self._buffers.values())
