"""Host-side page allocator for the paged KV pool.

Page 0 is reserved as scratch: padding tokens write there and padded page-table entries point
there, so it is never handed to a sequence. A sequence's pages need not be contiguous.
"""

from __future__ import annotations

from collections.abc import Hashable


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids are handed out first (easier to read in tests/logs).
        self._free = list(range(num_pages - 1, 0, -1))
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, total_len: int) -> int:
        """Pages needed to hold `total_len` tokens."""
        return -(-total_len // self.page_size)

    def pages_needed(self, seq_id: Hashable, total_len: int) -> int:
        """Additional pages `allocate(seq_id, total_len)` would take (0 if it already fits)."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.pages_for(total_len) - have)

    def allocate(self, seq_id: Hashable, total_len: int) -> list[int]:
        """Grow `seq_id`'s page table to hold `total_len` tokens; return the table (a copy).

        All or nothing: raises `OutOfPages` without allocating when the pool is short.
        """
        if total_len < 0:
            raise ValueError(f"total_len must be >= 0, got {total_len}")
        need = self.pages_needed(seq_id, total_len)
        if need > len(self._free):
            raise OutOfPages(
                f"sequence {seq_id!r} needs {need} more pages for {total_len} tokens, "
                f"only {len(self._free)} free"
            )
        table = self._tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.pop())
        return list(table)

    def page_table(self, seq_id: Hashable) -> list[int]:
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return list(self._tables[seq_id])

    def free(self, seq_id: Hashable) -> int:
        """Return all of `seq_id`'s pages to the pool; unknown ids are a no-op. Returns the number
        of pages freed."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        return len(table)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables
