"""The PolyServe batch policy: no decode stalls, dynamic chunking, prefills by first-token deadline (DESIGN.md §2)."""
from __future__ import annotations

from typing import Sequence

from scheduler.chunking import largest_chunk
from scheduler.headroom import Headroom
from scheduler.latency_model import LatencyModel
from scheduler.slo import next_token_deadline
from scheduler.types import KvState, SchedulableRequest, StepPlan, blocks_needed, is_decoding


class PolyServePolicy:
    """Each step:
    1. Every running decode gets its token. If KV blocks run short, the running requests with the most slack
       (next-token deadline - now) are preempted until the rest fit: the ones closest to missing keep their KV.
    2. Budget: the tightest per-token budget among the decodes, max(next-token deadline - now, tpot) each (a late
       request is not allowed to shrink the budget below its own TPOT, or one late token would stall prefill),
       planned against the SLO shrunk by the headroom's margin m: deadline arrival + (1 - m) (ttft + k tpot), floor
       (1 - m) tpot. A prediction is not a measurement: each token then gains m tpot on its true deadline, a
       reserve that grows with the output, and what a slow step or a stall costs comes out of it. A request the
       router placed with a reserve of its own (`tpot_reserve`, r) keeps at least r tpot before each deadline,
       its first tokens too, whose grown reserve is still small.
       Requests still in prefill emit no token this step, so they set no per-token budget: their deadline orders
       the chunks instead (3).
    3. Prefill chunks, running ones and waiting ones alike, in order of the deadline of the token each emits next
       (earliest first: a request that waited longer is not starved by newer ones): each takes the largest piece
       that keeps the predicted iteration within the budget, up to `max_prefill_chunk` tokens in all and the
       engine's token and sequence caps. With no decode running there is no per-token budget: full chunks.
    4. A new request is admitted only if its chunk leaves a block free for every decode (their growth reserve);
       after a preemption nobody new is admitted this step.
    """

    def __init__(self, latency_model: LatencyModel, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None = None, headroom: Headroom | None = None):
        """`headroom`: the margin its owner keeps current from measured outcomes (None: plan to the full budget)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(f"max_num_seqs {max_num_seqs} exceeds max_num_batched_tokens {max_num_batched_tokens}: "
                             "every running decode must fit in one step")
        if max_prefill_chunk is not None and max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be positive, got {max_prefill_chunk}")
        self.latency_model = latency_model
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.headroom = headroom

    def schedule(self, now: float, running: Sequence[SchedulableRequest],
                 waiting: Sequence[SchedulableRequest], kv: KvState) -> StepPlan:
        plan = StepPlan()
        block_size = kv.block_size
        decodes: list[SchedulableRequest] = []
        prefills: list[SchedulableRequest] = []
        blocks_wanted = 0
        for req in running:
            if is_decoding(req):
                decodes.append(req)
                extra = req.num_computed_tokens // block_size + 1 - req.num_blocks
                if extra > 0:
                    blocks_wanted += extra
            else:
                prefills.append(req)
        free = kv.num_free_blocks - blocks_wanted
        if free < 0:
            free = self._preempt(running, decodes, prefills, -free, block_size, plan)

        budget_s = float("inf")
        kv_tokens = 0
        margin = self.headroom.margin if self.headroom is not None else 0.0
        keep = 1.0 - margin
        for req in decodes:
            tpot_s = req.tpot_s * keep
            deadline = next_token_deadline(req)
            reserve = margin * (deadline - req.arrival)
            asked = req.tpot_reserve * req.tpot_s
            if reserve < asked:
                reserve = asked
            slack = deadline - now - reserve
            if slack < tpot_s:
                slack = tpot_s
            if slack < budget_s:
                budget_s = slack
            kv_tokens += req.num_tokens
        plan.scheduled = [(req, 1) for req in decodes]

        num_running = len(prefills)
        if not plan.preempted:  # under KV pressure nobody new: the preempted would come straight back
            prefills.extend(waiting)
        if not prefills:
            return plan
        deadlines = [next_token_deadline(req) for req in prefills]
        num_decodes = len(decodes)
        tokens_left = min(self.max_num_batched_tokens - num_decodes, self.max_prefill_chunk)
        seqs_left = self.max_num_seqs - num_decodes - num_running
        usable_blocks = free - num_decodes  # the decodes' growth reserve stays free
        model = self.latency_model
        num_prefill_tokens = 0
        for i in sorted(range(len(prefills)), key=deadlines.__getitem__):
            is_new = i >= num_running
            if is_new and seqs_left <= 0:
                continue
            req = prefills[i]
            computed = req.num_computed_tokens
            left = req.num_tokens - computed
            n = left if left < tokens_left else tokens_left
            if num_decodes:
                n = largest_chunk(model, budget_s, num_decodes, kv_tokens + computed, n, num_prefill_tokens)
            blocks = blocks_needed(req, n, block_size)
            if blocks > usable_blocks:
                n = min(n, (req.num_blocks + max(usable_blocks, 0)) * block_size - computed)
                blocks = blocks_needed(req, n, block_size) if n > 0 else 0
            if n <= 0:
                break
            plan.scheduled.append((req, n))
            num_prefill_tokens += n
            kv_tokens += computed + n
            tokens_left -= n
            usable_blocks -= blocks
            seqs_left -= is_new
            if n < left:
                break  # the budget, the token cap or the KV pool ended with this chunk
        return plan

    def _preempt(self, running: Sequence[SchedulableRequest], decodes: list[SchedulableRequest],
                 prefills: list[SchedulableRequest], shortfall: int, block_size: int, plan: StepPlan) -> int:
        """Preempt running requests, most slack (latest next-token deadline) first, until the decodes' new blocks
        fit; removes them from `decodes` and `prefills` and returns the blocks left free after the decodes'."""
        gone = set()
        for victim in sorted(running, key=next_token_deadline, reverse=True):
            if shortfall <= 0:
                break
            plan.preempted.append(victim)
            gone.add(id(victim))
            shortfall -= victim.num_blocks
            if is_decoding(victim):
                shortfall -= max(0, victim.num_computed_tokens // block_size + 1 - victim.num_blocks)
        decodes[:] = [r for r in decodes if id(r) not in gone]
        prefills[:] = [r for r in prefills if id(r) not in gone]
        return -shortfall
