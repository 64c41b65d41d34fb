"""Host memory the engine lays out itself: anonymous regions Linux may back with 2 MiB pages,
and the heap's freed pages handed back.

A step that reads a few GiB sequentially (a large model's weights at decode) or scattered
(the KV cache) runs at memory speed only on 2 MiB pages: with 4 KiB ones most reads also miss
the TLB and the hardware prefetchers stop at every page boundary. Llama-3.1-8B's Q4_K_M
matrices read from the file's mapping (page cache, 4 KiB pages): 504 ms a token; copied into
a region of 2 MiB pages: see `huge_page_copies`."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import mmap
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a region is made: processes without it use the rest
    import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor of a region starts on a cache line


def huge_page_region(length: int, what: str) -> torch.Tensor:
    """`length` bytes (uint8, not yet written) of one anonymous mapping advised MADV_HUGEPAGE
    (transparent huge pages, enabled as `madvise` or `always`), starting on a 2 MiB boundary;
    the tensor keeps the mapping alive. MemoryError naming `what` if it cannot be mapped."""
    import torch

    try:
        region = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as error:
        raise MemoryError(
            f"{what} ({length / 2**30:.2f} GiB) could not be mapped ({error.strerror})"
        ) from error
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages
            region.madvise(advice, start, length)
    return whole[start : start + length]


def huge_page_copies(tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """Copies of contiguous CPU tensors, back to back in one `huge_page_region` (each on a
    cache line); a tensor listed twice (the same storage and offset) is copied once."""
    offsets: dict[tuple[int, int], int] = {}
    length = 0
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.nbytes)
        if key not in offsets:
            offsets[key] = length
            length += -(-tensor.nbytes // _ALIGN) * _ALIGN
    region = huge_page_region(max(length, 1), what)
    copies = []
    for tensor in tensors:
        offset = offsets[(tensor.data_ptr(), tensor.nbytes)]
        flat = region[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        copies.append(flat)
    done: set[int] = set()
    for tensor, copy in zip(tensors, copies, strict=True):
        if copy.data_ptr() not in done:
            copy.copy_(tensor)
            done.add(copy.data_ptr())
    return copies


@lru_cache(maxsize=1)
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim (None elsewhere): hands the heap's free pages back to the system."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system: what loading, converting or a freed
    grammar's lexer released otherwise stays in the process's arenas (the default model's
    engine core: 2,008 MB resident after loading, 1,763 MB after this)."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def freeze_startup_objects() -> None:
    """Keep what a process loaded at start (torch, transformers, the model, the tokenizer:
    hundreds of thousands of objects, alive as long as the process) out of the garbage
    collector's full passes, which otherwise walk all of it now and then: in the front end a
    pause of the event loop of 100-600 ms, in the engine core or a worker 1-3% of a decode
    step's CPU on the 1B shape."""
    gc.collect()
    gc.freeze()
