"""The attention context is the stepping thread's own: two engines stepping at once in one process each read theirs."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.context import AttentionContext, get_context, set_context


def _context(n: int) -> AttentionContext:
    return AttentionContext(torch.zeros(n, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
                            torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), n, n)


def test_each_thread_reads_the_context_it_set():
    both_set = threading.Barrier(2)
    seen: dict[int, int] = {}

    def step(n: int) -> None:
        set_context(_context(n))
        both_set.wait(timeout=10)  # the other thread has set its own by now
        seen[n] = get_context().max_seq_len
        set_context(None)

    threads = [threading.Thread(target=step, args=(n,)) for n in (3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == {3: 3, 5: 5}
    with pytest.raises(RuntimeError, match="outside a step"):
        get_context()  # this thread never set one
