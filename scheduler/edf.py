"""Earliest deadline first under a static token budget: the deadline-aware baseline without dynamic chunking."""
from __future__ import annotations

from typing import Sequence

from scheduler.fcfs import StaticBudgetPolicy
from scheduler.slo import next_token_deadline
from scheduler.types import KvState, SchedulableRequest, StepPlan, blocks_needed


class EDFPolicy(StaticBudgetPolicy):
    """All requests, running and waiting, in order of the deadline of the token each emits next; each takes what it
    still needs (1 token for a decode, a chunk of its prompt otherwise) until `max_num_batched_tokens` is spent, so
    a decode whose deadline is far can wait behind prefills (a decode stall: the price of a static budget). When KV
    runs out a running request is preempted, latest deadline first; a waiting request that does not fit ends the
    step's admissions, and so does any preemption.
    """

    def schedule(self, now: float, running: Sequence[SchedulableRequest],
                 waiting: Sequence[SchedulableRequest], kv: KvState) -> StepPlan:
        plan = StepPlan()
        block_size = kv.block_size
        budget = self.max_num_batched_tokens
        free = kv.num_free_blocks
        num_seqs = len(running)
        running_ids = {id(r) for r in running}
        # running requests in the order the loop meets them: those met form a prefix, those still ahead (later
        # deadlines) the tail, which gives up its KV first
        victims = sorted(running, key=next_token_deadline)
        num_met = 0
        dropped: set[int] = set()
        admitting = True
        for req in sorted([*running, *waiting], key=next_token_deadline):
            if budget <= 0:
                break
            key = id(req)
            if key in dropped:
                continue
            is_new = key not in running_ids
            if is_new and (not admitting or num_seqs >= self.max_num_seqs):
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = blocks_needed(req, n, block_size)
            if is_new:
                if need > free:
                    admitting = False
                    continue
                num_seqs += 1
            else:
                num_met += 1
                while need > free and len(victims) > num_met:
                    victim = victims.pop()
                    plan.preempted.append(victim)
                    dropped.add(id(victim))
                    free += victim.num_blocks
                    admitting = False
                if need > free:
                    n = (req.num_blocks + free) * block_size - req.num_computed_tokens
                    if n <= 0:
                        plan.preempted.append(req)
                        dropped.add(key)
                        free += req.num_blocks
                        continue
                    need = blocks_needed(req, n, block_size)
            free -= need
            budget -= n
            plan.scheduled.append((req, n))
        return plan
