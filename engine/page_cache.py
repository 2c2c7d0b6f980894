"""Shared-prefix caching: which pages of one KV pool hold which prompt prefix.

A cached page is keyed by (its parent page, its tokens): the page holding prompt tokens
[i*P, (i+1)*P) under the page holding [(i-1)*P, i*P). Keys compare the tokens exactly, so a match is
never a hash collision, and the chain makes a page's key name its whole prefix. Only whole pages of
prefilled tokens are cached (prompts', and a recompute's generated tokens, whose KV depends on the tokens
before them alone as well), and a registered page's parent is always registered: a sequence registers
its pages in order and stops at the first one another sequence registered first.

Pages no sequence holds stay cached and count as free; the pool takes them back least recently used
first (`evict`), and a page leaves the index together with every page cached under it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceT

ROOT = -1  # the parent of a prompt's first page
PageKey = tuple[int, tuple[int, ...]]  # (parent page, the page's token ids)


class PageCache:
    def __init__(self) -> None:
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._children: dict[int, set[int]] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, held by no sequence; oldest first

    def __len__(self) -> int:
        return len(self._key_of)

    def lookup(self, parent: int, tokens: SequenceT[int]) -> int | None:
        return self._page_of.get((parent, tuple(tokens)))

    def match(self, token_ids: SequenceT[int], page_size: int, max_pages: int) -> list[int]:
        """The cached pages holding the longest prefix of `token_ids`, at most `max_pages` of them."""
        pages: list[int] = []
        parent = ROOT
        for i in range(max_pages):
            page = self.lookup(parent, token_ids[i * page_size : (i + 1) * page_size])
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def insert(self, page: int, parent: int, tokens: SequenceT[int]) -> bool:
        """Cache `page` as holding `tokens` under `parent`; False when that prefix is cached already (in
        another page) or `page` is, in which case nothing changes."""
        key = (parent, tuple(tokens))
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        self._children.setdefault(parent, set()).add(page)
        return True

    def tokens_of(self, page: int) -> tuple[int, ...] | None:
        key = self._key_of.get(page)
        return None if key is None else key[1]

    def cached(self, page: int) -> bool:
        return page in self._key_of

    def evict(self) -> list[int]:
        """Drop the least recently used idle page from the cache, with every page cached under it; returns
        those of them no sequence holds (now plain free pages)."""
        page, _ = self.idle.popitem(last=False)
        freed = [page]
        stack = [page]
        while stack:
            current = stack.pop()
            key = self._key_of.pop(current)
            del self._page_of[key]
            self._children.get(key[0], set()).discard(current)
            for child in self._children.pop(current, set()):
                stack.append(child)
                if child in self.idle:
                    del self.idle[child]
                    freed.append(child)
        return freed
