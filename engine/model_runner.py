"""The real-model executor: weights, the paged KV pool, and one forward + sample per step."""
from __future__ import annotations

import contextlib
import logging

import torch

from engine.config import EngineConfig
from engine.context import AttentionContext, set_context
from engine.executor import StepBatch
from engine.loader import load_model
from engine.model_config import DTYPES, ModelConfig
from engine.sampler import SamplerOutput, sample, span_logprobs
from kernels import get_ops, leading_decodes

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, config: EngineConfig):
        self.cfg, self.device, self.block_size = model_cfg, torch.device(config.device), config.block_size
        if config.dtype is not None:
            self.dtype = DTYPES[config.dtype]
        else:
            self.dtype = model_cfg.dtype if self.device.type == "cuda" else torch.float32
        self.vocab_size = model_cfg.vocab_size
        ops = get_ops(self.device, backend=None if config.kernels == "auto" else config.kernels)
        self.model = load_model(model_cfg, ops, self.device, self.dtype)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            pack_linears_for_onednn(self.model)
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_that_fit(config.kv_cache_memory,
                                                                           config.gpu_memory_utilization)
        if self.num_kv_blocks < 1:
            raise ValueError("no memory left for the KV cache")
        # block-major: a block's K and V of every layer are one run of bytes, what a KV hand-off sends
        # (engine.kv_transfer); each layer's cache is a view whose blocks are strided
        self.kv_cache = torch.empty(self.num_kv_blocks, model_cfg.num_layers, 2, self.block_size,
                                    model_cfg.num_kv_heads, model_cfg.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv_cache[:, i, 0], self.kv_cache[:, i, 1]
        self.graphs = None
        max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        if ops.name in ("triton", "triton-interpreter", "cuda"):  # Triton kernels: every variant compiles here
            with kernels_compiling():
                if self.device.type == "cuda" and not config.enforce_eager:  # these ops never sync: capturable
                    from engine.cuda_graphs import DecodeGraphs

                    with torch.inference_mode():
                        self.graphs = DecodeGraphs(self.model, config.max_num_seqs, max_model_len, self.block_size,
                                                   self.device)
                self._warm_up_eager_steps(max_model_len, config.max_num_seqs)

    @torch.inference_mode()
    def _warm_up_eager_steps(self, max_model_len: int, max_num_seqs: int) -> None:
        """The forward of a step with decode rows and a two-token prefill row, once with a short longest context
        and once with the longest the engine allows, and with one decode row and (where the engine allows that
        many) as many as take the long decode tile: every kernel variant an eager step launches (both decode tile
        lengths, with and without split-KV, the merge, prefill tiles) compiles now, not in the first step that
        needs it. The rows write no KV (slot -1) and read block 0, zeroed first so that nothing computes on stale
        memory."""
        from kernels.attention import LONG_DECODE_MIN_SEQS  # Triton: only where Triton kernels run

        dev = self.device
        self.kv_cache[0].zero_()
        for decodes in sorted({1, min(LONG_DECODE_MIN_SEQS, max_num_seqs)}):
            for max_seq_len in (2, max_model_len):
                set_context(AttentionContext(
                    slot_mapping=torch.full((decodes + 2,), -1, dtype=torch.long, device=dev),
                    block_tables=torch.zeros((decodes + 1, 1), dtype=torch.int32, device=dev),
                    seq_lens=torch.tensor([1] * decodes + [2], dtype=torch.int32, device=dev),
                    query_start_loc=torch.tensor([*range(decodes + 1), decodes + 2], dtype=torch.int32, device=dev),
                    max_seq_len=max_seq_len, max_query_len=2, num_decodes=decodes))
                try:
                    self.model(torch.zeros(decodes + 2, dtype=torch.long, device=dev),
                               torch.tensor([0] * decodes + [0, 1], device=dev))
                finally:
                    set_context(None)

    def _blocks_that_fit(self, kv_cache_memory: int, gpu_memory_utilization: float) -> int:
        per_block = self.cfg.kv_bytes_per_token(self.dtype) * self.block_size
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - gpu_memory_utilization) * total
            return int(budget // per_block)
        return int(kv_cache_memory // per_block)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> SamplerOutput:
        meta, dev = batch.meta, self.device
        if self.graphs is not None and self.graphs.fits(len(meta.seq_lens), len(meta.input_ids)):
            return self._sample(self.graphs.run(meta), batch)
        input_ids = torch.from_numpy(meta.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(meta.positions).to(dev, non_blocking=True)
        seq_lens = torch.from_numpy(meta.seq_lens)
        qsl = torch.from_numpy(meta.query_start_loc)
        q_lens = qsl[1:] - qsl[:-1]
        set_context(AttentionContext(
            slot_mapping=torch.from_numpy(meta.slot_mapping).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(meta.block_tables).to(dev, non_blocking=True),
            seq_lens=seq_lens.to(dev, non_blocking=True),
            query_start_loc=qsl.to(dev, non_blocking=True),
            max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
            max_query_len=int(q_lens.max()) if len(q_lens) else 0,
            num_decodes=leading_decodes(q_lens),
        ))
        try:
            hidden = self.model(input_ids, positions)
        finally:
            set_context(None)
        return self._sample(hidden, batch)

    def _sample(self, hidden: torch.Tensor, batch: StepBatch) -> SamplerOutput:
        logits = self.model.compute_logits(hidden[torch.from_numpy(batch.meta.logits_indices).to(self.device)])
        out = sample(logits, batch.params, batch.generators, batch.grammar)
        if batch.prompt_spans:  # the logits of every prompt position, only for the requests that ask
            rows = torch.cat([torch.arange(s.first_row, s.first_row + len(s.next_token_ids))
                              for s in batch.prompt_spans]).to(self.device)
            out.prompt_logprobs = span_logprobs(self.model.compute_logits(hidden[rows]), batch.prompt_spans)
        return out


_runners_warming_up = 0  # model runners of this process compiling their kernels on purpose right now
_compile_warning_installed = False


@contextlib.contextmanager
def kernels_compiling():
    """Compiles inside are the warm-up's; from the first use on, any other Triton compile in this process logs a
    warning naming the kernel and its specialisation key: once serving, a compile is a stall of seconds in the
    middle of a step, and the sign of a launch that specialises on something that varies per step. (The
    interpreter compiles nothing and never warns.)"""
    global _runners_warming_up
    _install_compile_warning()
    _runners_warming_up += 1
    try:
        yield
    finally:
        _runners_warming_up -= 1


def _install_compile_warning() -> None:
    global _compile_warning_installed
    if _compile_warning_installed:
        return
    import triton

    earlier = triton.knobs.runtime.jit_post_compile_hook

    def warn(**compiled):
        if not _runners_warming_up:
            log.warning("Triton compiled %s after warm-up, while serving; specialisation key %s",
                        compiled["fn"].name, compiled["key"])
        if earlier is not None:
            earlier(**compiled)

    triton.knobs.runtime.jit_post_compile_hook = warn
    _compile_warning_installed = True


def onednn_packs_bf16() -> bool:
    """Can oneDNN pack bf16 weights on this CPU? It needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2-only part
    (many AMD EPYCs) has neither, and there the projections run as plain bf16 matmuls."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears_for_onednn(model: torch.nn.Module, batch_hint: int = 16) -> None:
    """bf16 on the CPU: pre-pack every projection's weight into oneDNN's blocked layout once, instead of on every
    call (oneDNN's packed GEMM is much faster at decode batch sizes on AMX/AVX-512 parts; the same result). Nothing
    where oneDNN cannot (`onednn_packs_bf16`)."""
    if not onednn_packs_bf16():
        return

    def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
            module.forward = packed_linear(module.weight.data, module.bias)
    lm_head = packed_linear(model.logits_weight().data, None)  # the tied embedding too: the biggest matrix
    model.compute_logits = lambda hidden: lm_head(hidden).float()
