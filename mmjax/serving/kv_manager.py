"""Paged KV-cache bookkeeping on the host: a page pool, per-request page tables, and a prefix cache.

The device holds `num_pages` KV pages of `page_size` tokens; this module only decides which page ids a request
uses. Page 0 is never handed out: it is the null page the model runner pads page tables with and writes the
KV of padding tokens to, so it holds garbage and no request reads it.

Prefix caching: a full page is keyed by a chained hash of (parent page's hash, the page's token ids, extra keys
such as image content hashes overlapping the page). Requests with the same prefix share those pages by reference
count. A page whose count drops to 0 keeps its KV and its hash ("evictable") until a page is needed and it is the
least recently freed one; plain free pages (no hash) are handed out before any cached page is evicted.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence

from mmjax.serving.request import ExtraKey, Request

NULL_PAGE = 0


def _encode_key(key: int | str | bytes) -> bytes:
    """Canonical, type-tagged bytes of one extra key (so 1, "1" and b"1" differ)."""
    if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
        raise TypeError(f"extra key {key!r}: must be int, str or bytes")
    if isinstance(key, int):
        data, tag = str(key).encode(), b"i"
    elif isinstance(key, str):
        data, tag = key.encode(), b"s"
    else:
        data, tag = key, b"b"
    return tag + struct.pack("<Q", len(data)) + data


def hash_page(parent: bytes, token_ids: Sequence[int], extra: Sequence[tuple[int, int, int | str | bytes]] = ()
              ) -> bytes:
    """Stable 32-byte hash of one full page, chained on its parent's hash.

    `extra` holds (start, end, key) of every extra-key range overlapping the page, start/end relative to the page
    start (so where an image begins and ends inside the page is part of the key). blake2b, not `hash()`: Python
    salts string hashes per process.
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(struct.pack("<Q", len(parent)) + parent)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<Q", len(extra)))
    for start, end, key in extra:
        h.update(struct.pack("<qq", start, end) + _encode_key(key))
    return h.digest()


def page_extra_keys(extra_keys: Sequence[ExtraKey], page_start: int, page_end: int
                    ) -> list[tuple[int, int, int | str | bytes]]:
    """The extra keys overlapping [page_start, page_end), with ranges relative to page_start."""
    return [(k.start - page_start, k.end - page_start, k.key) for k in extra_keys
            if k.start < page_end and k.end > page_start]


class KVCacheManager:
    """Page pool with reference counts, LRU-evictable cached pages, and per-request page tables.

    Every usable page (1 .. num_pages-1) is in exactly one state: in use (ref count > 0, in one or more page
    tables; shared ones carry a hash), free (count 0, no hash) or evictable (count 0, hash kept, LRU order).
    """

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 hash_seed: bytes = b"") -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the reserved null page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed  # root of every hash chain: e.g. the model id, so caches never mix models
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self._hash_to_page: dict[bytes, int] = {}
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._tables: dict[str, list[int]] = {}
        self._num_hashed_pages: dict[str, int] = {}  # leading pages of the table that are in the cache
        self._forked: set[int] = set()  # pages shared by `fork` (beam search) rather than the prefix cache
        self.queries = 0  # prompt(+output) tokens looked up on admission
        self.hits = 0  # of those, tokens found in the cache
        self.evictions = 0  # cached pages whose hash was dropped to reuse the page

    # -- pool state -------------------------------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Share of usable pages in use (evictable cached pages count as free)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's page ids, position p lives in page table[p // page_size]. Do not mutate."""
        return self._tables.get(request_id, [])

    # -- prefix cache -----------------------------------------------------------------------------------------

    def page_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """Hashes of the request's first `num_pages` full pages (of known tokens), extending its cached chain."""
        hashes = request.page_hashes
        size = self.page_size
        while len(hashes) < num_pages:
            i = len(hashes)
            start, end = i * size, (i + 1) * size
            parent = hashes[-1] if hashes else self.hash_seed
            hashes.append(hash_page(parent, request.token_ids(start, end),
                                    page_extra_keys(request.extra_keys, start, end)))
        return hashes[:num_pages]

    def get_computed_pages(self, request: Request) -> tuple[list[int], int]:
        """Cached pages holding the request's longest cached prefix, and the number of tokens they cover.

        Never the whole sequence: the last known token is always recomputed so the runner has its logits.
        Read-only; `allocate_slots` takes the pages (and counts the query) once the request is admitted.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_pages = (request.num_tokens - 1) // self.page_size
        pages = []
        for h in self.page_hashes(request, max_pages):
            page = self._hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        # Never end inside an extra-key range (an image is computed whole): cut back to a page before it.
        for k in reversed(request.extra_keys):
            if k.start < len(pages) * self.page_size < k.end:
                pages = pages[:k.start // self.page_size]
        return pages, len(pages) * self.page_size

    def cache_pages(self, request: Request) -> None:
        """Register the request's full, computed pages in the prefix cache (call after its KV was written)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        done = self._num_hashed_pages[rid]
        # only pages of known tokens: a placeholder (a token still on the device) is not hashed
        known = min(request.num_computed_tokens, request.num_tokens - request.num_output_placeholders)
        full = min(known // self.page_size, len(table))
        if full <= done:
            return
        hashes = self.page_hashes(request, full)
        for i in range(done, full):
            page, h = table[i], hashes[i]
            if self.page_hash[page] is None and h not in self._hash_to_page:
                # A page computed twice (two requests admitted before either finished the prefix) stays unhashed.
                self.page_hash[page] = h
                self._hash_to_page[h] = page
        self._num_hashed_pages[rid] = full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update) when no page is in use; False otherwise."""
        if self._tables:
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self.page_hash = [None] * self.num_pages
        self._hash_to_page.clear()
        return True

    # -- allocation -------------------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_pages: Sequence[int] = (),
                       num_computed_tokens: int = 0) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of the request; returns the newly added page ids.

        On admission pass the hit from `get_computed_pages` as `computed_pages`/`num_computed_tokens`: those pages
        join the table (shared). Returns None, changing nothing, when not enough pages are free: the scheduler
        then preempts or waits.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            table = []
        elif computed_pages:
            raise ValueError(f"request {rid!r}: computed pages are only taken on admission")
        total = request.num_computed_tokens + num_computed_tokens + num_new_tokens
        need = self.pages_for(total) - len(table) - len(computed_pages)
        reclaimed = sum(1 for p in computed_pages if self.ref_counts[p] == 0)  # evictable now, in use after
        if need > self.num_free_pages - reclaimed:
            return None
        if rid not in self._tables:
            self._tables[rid] = table
            self._num_hashed_pages[rid] = len(computed_pages)
            self.queries += request.num_tokens
            self.hits += num_computed_tokens
        for page in computed_pages:
            if self.ref_counts[page] == 0:
                del self._evictable[page]
            self.ref_counts[page] += 1
            table.append(page)
        new = [self._take_page() for _ in range(max(need, 0))]
        table.extend(new)
        return new

    def _take_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._hash_to_page[self.page_hash[page]]
            self.page_hash[page] = None
            self.evictions += 1
        self.ref_counts[page] = 1
        return page

    def fork(self, src_id: str, dst_id: str) -> None:
        """Give `dst_id` the page table of `src_id`, every page shared by reference count (a beam search fork).
        The first write to a shared page goes through `copy_on_write`."""
        if dst_id in self._tables:
            raise ValueError(f"fork: {dst_id!r} already has a page table")
        table = self._tables[src_id]
        for page in table:
            self.ref_counts[page] += 1
            if self.page_hash[page] is None:
                self._forked.add(page)
        self._tables[dst_id] = list(table)
        self._num_hashed_pages[dst_id] = self._num_hashed_pages[src_id]

    def copy_on_write(self, request_id: str, position: int) -> tuple[int, int] | None | bool:
        """Before writing `position`: when its page is shared by a fork, give the request a private copy.
        Returns (src page, new page) for the device to copy, True when nothing needs copying, None when no
        page is free (nothing changed). Full prefix-cached pages are never written, so only forks copy."""
        table = self._tables[request_id]
        index = position // self.page_size
        if index >= len(table) or self.ref_counts[table[index]] == 1:
            return True
        if self.num_free_pages < 1:
            return None
        src = table[index]
        dst = self._take_page()
        table[index] = dst
        self._release(src)
        return src, dst

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the pages past the first `num_tokens` positions (rejected speculative tokens' pages)."""
        table = self._tables.get(request_id)
        keep = self.pages_for(num_tokens)
        while table is not None and len(table) > keep:
            self._release(table.pop())

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self._forked.discard(page)
            if self.page_hash[page] is None:
                self._free.append(page)
            else:
                self._evictable[page] = None

    def free(self, request_id: str) -> None:
        """Release the request's pages. Tail pages are released first, so a cached prefix's head outlives its
        tail in the LRU order (a head page is useful to more future prompts)."""
        table = self._tables.pop(request_id, None)
        self._num_hashed_pages.pop(request_id, None)
        if table is None:
            return
        for page in reversed(table):
            self._release(page)

    # -- debugging --------------------------------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Raise AssertionError when the bookkeeping is broken (tests and debug runs)."""
        uses = collections.Counter(p for table in self._tables.values() for p in table)
        assert NULL_PAGE not in uses and self.ref_counts[NULL_PAGE] == 0, "null page handed out"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is twice in the free queue"
        assert not free & evictable, "a page is both free and evictable"
        for page in range(1, self.num_pages):
            count = self.ref_counts[page]
            assert count == uses[page], f"page {page}: ref count {count} but {uses[page]} page tables hold it"
            assert (count > 0) + (page in free) + (page in evictable) == 1, f"page {page} in no or several states"
            if page in free:
                assert self.page_hash[page] is None, f"free page {page} still has a hash"
            if page in evictable:
                assert self.page_hash[page] is not None, f"evictable page {page} has no hash"
            if count > 1:
                assert self.page_hash[page] is not None or page in self._forked, \
                    f"page {page} shared but not through the prefix cache or a fork"
            h = self.page_hash[page]
            if h is not None:
                assert self._hash_to_page.get(h) == page, f"page {page}: hash map out of sync"
        assert len(self._hash_to_page) == sum(h is not None for h in self.page_hash), "stale hash map entries"
