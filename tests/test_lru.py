"""core/lru.py: the bounded cache the compiler and the runtime share."""
from __future__ import annotations

import threading

from meshdsl.core.lru import Lru


def test_it_keeps_the_most_recently_used_entries_and_makes_each_missing_one_once():
    made = []
    cache = Lru(2)

    def make(k):
        made.append(k)
        return k * 10
    assert cache.get_or_make("a", lambda: make(1)) == 10
    assert cache.get_or_make("b", lambda: make(2)) == 20
    assert cache.get_or_make("a", lambda: make(9)) == 10      # a hit: used again, not made
    assert cache.get_or_make("c", lambda: make(3)) == 30      # evicts "b", the least recently used
    assert len(cache) == 2
    assert cache.get_or_make("b", lambda: make(4)) == 40      # made again
    assert made == [1, 2, 3, 4]


def test_a_none_value_is_kept_like_any_other():
    calls = []
    cache = Lru(4)
    for _ in range(3):
        assert cache.get_or_make("k", lambda: calls.append(1)) is None
    assert calls == [1]


def test_threads_filling_it_at_once_leave_it_bounded_and_consistent():
    cache = Lru(8)

    def work(t):
        for i in range(200):
            assert cache.get_or_make(i % 16, lambda i=i: (i % 16) ** 2) == (i % 16) ** 2
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(cache) <= 8
