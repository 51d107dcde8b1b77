"""First come, first served: the static-budget baseline (Sarathi-style chunked prefill)."""
from __future__ import annotations

from typing import Sequence

from scheduler.types import KvState, SchedulableRequest, StepPlan, blocks_needed


class StaticBudgetPolicy:
    """A policy that spends a fixed token budget per step over at most `max_num_seqs` sequences (the baselines)."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens


class FCFSPolicy(StaticBudgetPolicy):
    """First come, first served under a static token budget (Sarathi-style chunked prefill).

    Running requests go first, oldest first; each takes what it still needs (1 token for a decode, a chunk for an
    unfinished prefill). When KV runs out the youngest running request is preempted (recompute). Waiting requests
    are admitted in arrival order until the budget, the sequence cap or the KV pool stops the queue.
    """

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int):
        super().__init__(max_num_seqs, max_num_batched_tokens)

    def schedule(self, now: float, running: Sequence[SchedulableRequest],
                 waiting: Sequence[SchedulableRequest], kv: KvState) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        free = kv.num_free_blocks
        queue = list(running)  # oldest first; the tail is the first to be preempted
        i = 0
        while i < len(queue) and budget > 0:
            req = queue[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = blocks_needed(req, n, kv.block_size)
            while need > free and len(queue) - 1 > i:
                victim = queue.pop()
                plan.preempted.append(victim)
                free += victim.num_blocks
            if need > free:
                plan.preempted.append(req)
                free += req.num_blocks
                queue.pop(i)
                continue
            free -= need
            budget -= n
            plan.scheduled.append((req, n))
            i += 1
        if plan.preempted:
            return plan
        num_seqs = len(plan.scheduled)
        for req in waiting:
            if budget <= 0 or num_seqs >= self.max_num_seqs:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = blocks_needed(req, n, kv.block_size)
            if need > free:
                break
            free -= need
            budget -= n
            num_seqs += 1
            plan.scheduled.append((req, n))
        return plan
