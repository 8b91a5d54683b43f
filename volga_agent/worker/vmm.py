"""A weight arena whose GPU addresses survive WARM: CUDA virtual memory management through ctypes.

The arena reserves a virtual address range once (`cuMemAddressReserve`) and maps physical memory into it
(`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`). Going WARM copies the weights to pinned host memory and
unmaps and releases the physical pages, so the GPU holds only the context; waking maps new pages at the
same addresses and copies the weights back. Every pointer a CUDA graph captured before is valid again, so
graphs replay after a wake without being captured anew.

PyTorch sees the arena as a uint8 tensor built from `__cuda_array_interface__` (no copy); parameters are
views into it. The process must have a current CUDA context (PyTorch makes one on first use).

The physical memory comes in chunks (256 MiB by default), each its own allocation: a wake maps chunk i+1
on the CPU while the copy engine fills chunk i, so creating physical memory costs no time beyond the copy.
"""

from __future__ import annotations

import ctypes
from typing import Any

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class VmmError(RuntimeError):
    pass


class _CudaArray:
    """Just enough of `__cuda_array_interface__` for torch.as_tensor to wrap a device pointer."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class Arena:
    """`nbytes` of device memory at a fixed virtual address, whose physical pages can come and go."""

    def __init__(self, nbytes: int, device: int, library: str = "libcuda.so.1", chunk_bytes: int = 256 * 2**20) -> None:
        self.lib = ctypes.CDLL(library)
        self.device = device
        self.prop = _Prop(type=CU_MEM_ALLOCATION_TYPE_PINNED, location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device))
        granularity = ctypes.c_size_t(0)
        self._check("cuMemGetAllocationGranularity", self.lib.cuMemGetAllocationGranularity(
            ctypes.byref(granularity), ctypes.byref(self.prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        self.granularity = granularity.value
        self.nbytes = nbytes
        self.size = -(-max(nbytes, 1) // self.granularity) * self.granularity
        self.chunk = max(self.granularity, chunk_bytes // self.granularity * self.granularity)
        self.chunks = [(off, min(self.chunk, self.size - off)) for off in range(0, self.size, self.chunk)]
        ptr = ctypes.c_uint64(0)
        self._check("cuMemAddressReserve", self.lib.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0), ctypes.c_uint64(0),
            ctypes.c_ulonglong(0)))
        self.ptr = ptr.value
        self.handles: dict[int, int] = {}
        self.map()

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            raise VmmError(f"{call} failed: {(name.value or b'?').decode()} ({code})")

    @property
    def mapped(self) -> bool:
        return bool(self.handles)

    def map_chunk(self, index: int) -> tuple[int, int]:
        """Back one chunk of the range with fresh physical memory; returns its (offset, size)."""
        offset, size = self.chunks[index]
        handle = ctypes.c_uint64(0)
        self._check("cuMemCreate", self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size),
                                                        ctypes.byref(self.prop), ctypes.c_ulonglong(0)))
        try:
            self._check("cuMemMap", self.lib.cuMemMap(ctypes.c_uint64(self.ptr + offset), ctypes.c_size_t(size),
                                                      ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)))
            access = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, self.device),
                                 CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            self._check("cuMemSetAccess", self.lib.cuMemSetAccess(
                ctypes.c_uint64(self.ptr + offset), ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)))
        except VmmError:
            self.lib.cuMemUnmap(ctypes.c_uint64(self.ptr + offset), ctypes.c_size_t(size))
            self.lib.cuMemRelease(handle)
            raise
        self.handles[index] = handle.value
        return offset, size

    def map(self) -> None:
        """Back the whole range with physical memory (contents undefined until written)."""
        for index in range(len(self.chunks)):
            if index not in self.handles:
                self.map_chunk(index)

    def unmap(self) -> None:
        """Give the physical memory back; the addresses stay reserved for the next `map`."""
        for index, handle in sorted(self.handles.items()):
            offset, size = self.chunks[index]
            self._check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_uint64(self.ptr + offset), ctypes.c_size_t(size)))
            self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_uint64(handle)))
        self.handles.clear()

    def tensor(self, torch: Any) -> Any:
        """The arena as a flat uint8 tensor on its device (valid while mapped)."""
        return torch.as_tensor(_CudaArray(self.ptr, self.nbytes), device=f"cuda:{self.device}")
