"""Which rank of an engine group holds a prompt prefix in its page cache.

A prefill stage sends a prefix shared by the rows of a batch once: later rows' KV starts after it (`kv_start`),
and the decode engine takes it from its page cache, where the row carrying it left it. A group placing rows by load
alone sent such a row to a rank without the prefix about half the time on two ranks, and that rank prefilled the
whole prompt again. So the group remembers, for the prompts it placed, which rank got each of their whole-page
prefixes (a chained hash per page, the most recent MAX_PREFIXES kept), and a row whose KV leaves out a prefix goes
to that rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

MAX_PREFIXES = 1 << 16  # page-aligned prefixes remembered (a chained hash and a rank each)


class PrefixPlacement:
    def __init__(self, page_size: int, capacity: int = MAX_PREFIXES):
        self.page_size = page_size
        self.capacity = capacity
        self._rank_of: OrderedDict[int, int] = OrderedDict()  # chained hash of a prefix -> the rank caching it

    def placed(self, prompt: list[int], rank: int) -> None:
        """`prompt` went to `rank`, which caches each of its whole pages once it holds the prompt's KV."""
        for key in _prefix_keys(prompt, self.page_size, len(prompt) // self.page_size):
            self._rank_of[key] = rank
            self._rank_of.move_to_end(key)
        while len(self._rank_of) > self.capacity:
            self._rank_of.popitem(last=False)

    def rank_of(self, prompt: list[int], tokens: int) -> int | None:
        """The rank that got a prompt starting with `prompt`'s first `tokens` (whole pages), if one is remembered."""
        pages = tokens // self.page_size
        if pages == 0:
            return None
        *_, key = _prefix_keys(prompt, self.page_size, pages)
        return self._rank_of.get(key)


def _prefix_keys(prompt: list[int], page_size: int, pages: int) -> Iterator[int]:
    """The chained hash of each of `prompt`'s first `pages` whole-page prefixes, in order."""
    key = 0
    for start in range(0, pages * page_size, page_size):
        key = hash((key, tuple(prompt[start:start + page_size])))
        yield key
