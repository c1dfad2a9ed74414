"""The host side of a paged KV cache: one data group's pool of pages, reference-counted so a
prompt's pages can be shared by the answers that continue it (SGLang's / vLLM's prefix
sharing), with copy-on-write at the first page an answer writes into while others still read it.

    pool = PagePool(pages=65, page_size=16)   # page 0 is the null page (`NULL_PAGE`)
    table = []                                # a sequence's page ids, logical page i -> id
    copies = pool.prepare_write(table, start=0, stop=40)   # pages for positions 0..39
    child = pool.fork(table)                  # a second sequence reading the same pages
    pool.free(table)

Nothing here touches the device: `prepare_write` returns the (source, destination) page copies
the next compiled step performs before it writes, and the engine builds its page tables from
the lists.
"""

from __future__ import annotations

from zeroxla.models.paged_attention import NULL_PAGE


class OutOfPages(RuntimeError):
    """The pool has no free page for a write (the scheduler preempts a sequence and retries)."""


class PagePool:
    """Free list and reference counts of `pages` pages (page 0, the null page, never handed
    out) of `page_size` slots."""

    def __init__(self, pages: int, page_size: int):
        if pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (the null page and one); "
                             f"got {pages}")
        self.pages, self.page_size = pages, page_size
        self._free = list(range(pages - 1, NULL_PAGE, -1))     # pop() hands out 1, 2, ...
        self._refs = [0] * pages
        self.peak = 0                                          # most pages in use at once

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Pages holding some sequence's tokens (shared ones counted once)."""
        return self.pages - 1 - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _take(self) -> int:
        if not self._free:
            raise OutOfPages(f"all {self.pages - 1} pages of {self.page_size} slots are in use")
        page = self._free.pop()
        self._refs[page] = 1
        self.peak = max(self.peak, self.in_use)
        return page

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def prepare_write(self, table: list[int], start: int, stop: int) -> list[tuple[int, int]]:
        """Makes positions [start, stop) of the sequence `table` writable: appends fresh pages
        for the logical pages it lacks and replaces each shared page in the range by a private
        copy. Returns the (source, destination) copies to perform before the write. On
        OutOfPages nothing is changed."""
        first, last = start // self.page_size, self.pages_for(stop)
        shared = [i for i in range(first, min(last, len(table))) if self._refs[table[i]] > 1]
        needed = max(0, last - len(table)) + len(shared)
        if needed > len(self._free):
            raise OutOfPages(f"{needed} pages needed, {len(self._free)} free")
        copies = []
        for i in shared:
            page = self._take()
            copies.append((table[i], page))
            self._drop(table[i])
            table[i] = page
        while len(table) < last:
            table.append(self._take())
        return copies

    def fork(self, table: list[int]) -> list[int]:
        """A new sequence reading `table`'s pages (each shared, copied on its first write)."""
        for page in table:
            self._refs[page] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        """Drops the sequence's hold on its pages (a page no sequence holds returns to the
        free list)."""
        for page in table:
            self._drop(page)
        table.clear()


__all__ = ["OutOfPages", "PagePool"]
