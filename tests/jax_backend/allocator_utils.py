"""Test-only allocator operations (the runtime never shrinks a sequence's pages: a rollback just
runs the next block from a shorter start position)."""

from __future__ import annotations

from collections.abc import Hashable

from jax_backend import PageAllocator


def truncate(alloc: PageAllocator, seq_id: Hashable, total_len: int) -> int:
    """Give back the pages of `seq_id` past the first `total_len` tokens; returns how many."""
    table = alloc._tables[seq_id]
    keep = alloc.pages_for(total_len)
    freed = table[keep:]
    del table[keep:]
    alloc._free.extend(reversed(freed))
    return len(freed)
