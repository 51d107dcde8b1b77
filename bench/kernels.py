"""Kernel microbenchmarks: time, achieved GB/s and TFLOP/s of every kernel, as fractions of the device's copy
bandwidth and bf16 matrix rate measured in the same run, beside torch's scaled_dot_product_attention on the same
problem gathered to contiguous form.

    python -m bench.kernels --out bench/results/kernels.json      # writes kernels.json and kernels.md
    python -m bench.kernels --cpu --out /tmp/kernels.json          # CPU mode (also the default without a GPU)

GPU mode: Llama-3-8B attention shapes (32 query / 8 KV heads, head dim 128, block 16, bf16); decode batches
{1, 8, 32, 128} x contexts {512, 4k, 16k}; prefill chunks {512, 2048} over prefixes {0, 4k}; the KV store at 128
and 16384 tokens; the fused small ops at 4096 tokens (hidden 4096, intermediate 14336). Each time is the median
over many runs between CUDA events, each run preceded by a 512 MiB write that evicts the 60 MB L2 (as
triton.testing.do_bench does) and keeps the GPU busy while the host enqueues the next launch, so times are device
times. Bytes are the unique bytes a kernel must move (K/V once, inputs read once, outputs written once); FLOPs count
2 per multiply-add, causal keys only.

CPU mode: the torch ops (reference, the CPU default `torch` bundle, SDPA) at reduced shapes in float32, wall-clock
medians. No GPU figure comes from it, and the output says so; the Triton kernels are not timed (the interpreter's
speed means nothing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import get_ops
from kernels.paged_batch import PagedBatch, random_paged_batch

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336
# Targets of issue 3 on an H200, as fractions of the measured ceilings.
TARGET_DECODE_BW, TARGET_PREFILL_MMA, TARGET_STORE_BW = 0.70, 0.40, 0.80


@dataclass(slots=True)
class Row:
    kernel: str
    impl: str
    shape: str
    seconds: float | None
    bytes: float
    flops: float
    note: str = ""
    target: str = ""  # "met" / "missed" where issue 3 sets one for this row
    derived: dict = field(default_factory=dict)


@dataclass(slots=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    timer: Callable[[Callable[[], object]], float]
    copy_bytes_per_s: float
    matmul_flops_per_s: float


# ---- timing ---------------------------------------------------------------------------------------------------

def cuda_timer(min_seconds: float = 0.15, max_runs: int = 200) -> Callable:
    flush = torch.empty(512 << 20, dtype=torch.int8, device="cuda")

    def run(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 3e3, 1e-6)
        runs = max(10, min(max_runs, int(min_seconds / estimate)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        for i in range(runs):
            flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3

    return run


def cpu_timer(min_seconds: float = 0.3, max_runs: int = 20) -> Callable:
    def run(fn: Callable[[], object]) -> float:
        times: list[float] = []
        while len(times) < 3 or (sum(times) < min_seconds and len(times) < max_runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return run


def measure_ceilings(device: torch.device, timer: Callable) -> tuple[float, float, str]:
    """Copy bandwidth (bytes read + written per second) and bf16 matrix rate, on random data."""
    if device.type == "cuda":
        copy_elems, n = 1 << 30, 8192
    else:
        copy_elems, n = 1 << 28, 1024
    src = torch.randint(0, 127, (copy_elems,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    copy_seconds = timer(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_seconds = timer(lambda: a @ b)
    return 2 * copy_elems / copy_seconds, 2 * n ** 3 / matmul_seconds, f"copy {copy_elems >> 20} MiB, matmul {n}^3"


# ---- problems -------------------------------------------------------------------------------------------------

def attention_bytes(batch: PagedBatch) -> float:
    element = batch.q.element_size()
    kv = 2 * sum(q + c for q, c in zip(batch.q_lens, batch.context_lens)) * KV_HEADS * HEAD_DIM * element
    return kv + 2 * batch.q.numel() * element  # + q read and out written


def attention_flops(batch: PagedBatch) -> float:
    return 4.0 * batch.keys_seen() * Q_HEADS * HEAD_DIM


def sdpa_inputs(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch gathered to [B, heads, len, D] (all sequences of a benchmark batch have equal lengths)."""
    from kernels.reference import gather_kv

    lengths = batch.seq_lens.tolist()
    keys = torch.stack([gather_kv(batch.k_cache, batch.block_tables[i], n) for i, n in enumerate(lengths)])
    values = torch.stack([gather_kv(batch.v_cache, batch.block_tables[i], n) for i, n in enumerate(lengths)])
    q = batch.q.view(len(lengths), -1, Q_HEADS, HEAD_DIM)
    return q.transpose(1, 2).contiguous(), keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
    """Causal with the queries aligned to the end of the keys (the decode/chunked-prefill alignment)."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if q_len == 1:
        mask, causal = None, False
    elif q_len == kv_len:
        mask, causal = None, True
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask, causal = causal_lower_right(q_len, kv_len), False
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=True)


def timed(setup: Setup, fn: Callable[[], object]) -> tuple[float | None, str]:
    try:
        return setup.timer(fn), ""
    except Exception as error:  # a baseline that cannot run this problem is reported, not fatal
        return None, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


def attention_rows(setup: Setup, impls: dict[str, Callable], decodes: list[tuple[int, int]],
                   prefills: list[tuple[int, int]]) -> list[Row]:
    rows = []
    problems = [("decode", f"bs={bs} ctx={ctx}", [1] * bs, [ctx - 1] * bs, 1) for bs, ctx in decodes]
    problems += [("prefill", f"chunk={chunk} prefix={prefix}", [chunk], [prefix], chunk) for chunk, prefix in prefills]
    for kind, shape, q_lens, contexts, max_query_len in problems:
        batch = random_paged_batch(q_lens, contexts, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, setup.dtype,
                                   setup.device, poison_unused=False)
        hints = dict(max_query_len=max_query_len, max_seq_len=max(q + c for q, c in zip(q_lens, contexts)))
        for impl, attend in impls.items():
            if kind == "prefill" and impl.startswith("cuda"):
                continue  # the CUDA C++ twin covers decode only; its bundle sends prefill to Triton
            seconds, note = timed(setup, lambda: attend(*batch.attention_args(), **hints))
            rows.append(Row(f"attention-{kind}", impl, shape, seconds, attention_bytes(batch), attention_flops(batch),
                            note))
        q, k, v = sdpa_inputs(batch)
        seconds, note = timed(setup, sdpa_call(q, k, v, batch.scale))
        rows.append(Row(f"attention-{kind}", "torch-sdpa (contiguous)", shape, seconds, attention_bytes(batch),
                        attention_flops(batch), note))
        del batch, q, k, v
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def store_rows(setup: Setup, impls: dict[str, Callable], token_counts: list[int]) -> list[Row]:
    rows = []
    generator = torch.Generator(setup.device).manual_seed(0)
    for tokens in token_counts:
        num_blocks = 2 * tokens // BLOCK_SIZE + 1
        k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=setup.device, dtype=setup.dtype)
        v = torch.randn_like(k)
        k_cache = torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=setup.device, dtype=setup.dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator, device=setup.device)[:tokens]
        moved = 2 * 2 * k.numel() * k.element_size() + slots.numel() * slots.element_size()
        for impl, store in impls.items():
            seconds, note = timed(setup, lambda: store(k, v, k_cache, v_cache, slots))
            rows.append(Row("kv-store", impl, f"tokens={tokens}", seconds, moved, 0.0, note))
    return rows


def build_small_op_problems(setup: Setup, tokens: int) -> list[tuple[str, str, Callable, float]]:
    """(kernel, shape, call(ops), bytes) for the norm, rotary and activation kernels."""
    device, dtype = setup.device, setup.dtype
    element = torch.finfo(dtype).bits // 8
    x = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device=device, dtype=dtype)
    qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device, dtype=dtype)
    q = qkv[:, :Q_HEADS * HEAD_DIM].view(tokens, Q_HEADS, HEAD_DIM)
    k = qkv[:, Q_HEADS * HEAD_DIM:(Q_HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    cos_sin = torch.randn(8192, HEAD_DIM, device=device, dtype=torch.float32)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device=device, dtype=dtype)
    rows_bytes = tokens * HIDDEN * element
    rotary_bytes = 2 * tokens * (Q_HEADS + KV_HEADS) * HEAD_DIM * element + tokens * HEAD_DIM * 4
    return [
        ("rms-norm", f"tokens={tokens} hidden={HIDDEN}", lambda ops: ops.rms_norm(x, weight, 1e-5), 2 * rows_bytes),
        ("fused-add-rms-norm", f"tokens={tokens} hidden={HIDDEN}",
         lambda ops: ops.fused_add_rms_norm(x, residual, weight, 1e-5), 4 * rows_bytes),
        ("rotary", f"tokens={tokens} heads={Q_HEADS}+{KV_HEADS} dim={HEAD_DIM}",
         lambda ops: ops.rotary_embedding(q, k, positions, cos_sin), rotary_bytes),
        ("silu-and-mul", f"tokens={tokens} intermediate={INTERMEDIATE}", lambda ops: ops.silu_and_mul(gate_up),
         3 * tokens * INTERMEDIATE * element),
    ]


def derive(rows: list[Row], setup: Setup) -> None:
    for row in rows:
        if row.seconds is None:
            continue
        bandwidth, rate = row.bytes / row.seconds, row.flops / row.seconds
        row.derived = dict(time_us=row.seconds * 1e6, GBps=bandwidth / 1e9, TFLOPs=rate / 1e12,
                           bw_fraction=bandwidth / setup.copy_bytes_per_s,
                           mma_fraction=rate / setup.matmul_flops_per_s)


def judge_targets(rows: list[Row]) -> None:
    """Issue 3's targets, on the GPU rows of our own kernels."""
    for row in rows:
        if row.seconds is None or row.impl.startswith("torch"):
            continue
        fraction = None
        if row.kernel == "attention-decode":
            bs, ctx = (int(part.split("=")[1]) for part in row.shape.split())
            if bs * ctx >= 32 * 4096:
                fraction, goal = row.derived["bw_fraction"], TARGET_DECODE_BW
        elif row.kernel == "attention-prefill" and row.shape.startswith("chunk=2048"):
            fraction, goal = row.derived["mma_fraction"], TARGET_PREFILL_MMA
        elif row.kernel == "kv-store" and row.shape == "tokens=16384":
            fraction, goal = row.derived["bw_fraction"], TARGET_STORE_BW
        if fraction is not None:
            row.target = f"{'met' if fraction >= goal else 'missed'} (goal {goal:.0%})"


def to_markdown(result: dict) -> str:
    ceilings = result["ceilings"]
    lines = [f"# Kernel microbenchmarks: {result['device']}", "", result["note"], "",
             f"Ceilings measured in this run ({ceilings['how']}): copy {ceilings['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {ceilings['matmul_TFLOPs']:.1f} TFLOP/s. torch {result['torch']}, triton "
             f"{result['triton']}, dtype {result['dtype']}.", "",
             "| kernel | impl | shape | time (us) | GB/s | TFLOP/s | % copy BW | % bf16 MMA | target | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for row in result["rows"]:
        d = row["derived"]
        if d:
            figures = (f"{d['time_us']:.1f} | {d['GBps']:.1f} | {d['TFLOPs']:.2f} | {100 * d['bw_fraction']:.1f} | "
                       f"{100 * d['mma_fraction']:.1f}")
        else:
            figures = "- | - | - | - | -"
        lines.append(f"| {row['kernel']} | {row['impl']} | {row['shape']} | {figures} | {row['target']} | "
                     f"{row['note']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON results path; the markdown table goes beside it (.md)")
    parser.add_argument("--cpu", action="store_true", help="CPU mode even where a GPU is present")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    timer = cuda_timer() if gpu else cpu_timer()
    copy_rate, matmul_rate, how = measure_ceilings(device, timer)
    setup = Setup(device, torch.bfloat16 if gpu else torch.float32, timer, copy_rate, matmul_rate)

    if gpu:
        triton_ops = get_ops("cuda", backend="triton")
        attention_impls = {"triton": triton_ops.paged_attention}
        reference = get_ops("cuda", backend="reference")
        store_impls = {"triton": triton_ops.store_kvcache, "torch-reference": reference.store_kvcache}
        bundles = {"triton": triton_ops, "torch-reference": reference}
        try:
            cuda_ops = get_ops("cuda", backend="cuda")
            attention_impls["cuda-c++ (decode) / triton"] = cuda_ops.paged_attention
            store_impls["cuda-c++"] = cuda_ops.store_kvcache
            cuda_note = ""
        except ImportError as error:
            cuda_note = f" CUDA C++ kernels not timed: {error}."
        decodes = [(bs, ctx) for bs in (1, 8, 32, 128) for ctx in (512, 4096, 16384)]
        prefills = [(chunk, prefix) for chunk in (512, 2048) for prefix in (0, 4096)]
        store_tokens, op_tokens = [128, 16384], 4096
        name = torch.cuda.get_device_name()
        note = f"GPU figures, device times (CUDA events).{cuda_note}"
    else:
        reference, torch_ops = get_ops("cpu", backend="reference"), get_ops("cpu")
        attention_impls = {"torch-reference": reference.paged_attention,
                           "torch (CPU default)": torch_ops.paged_attention}
        store_impls = {"torch-reference": reference.store_kvcache, "torch (CPU default)": torch_ops.store_kvcache}
        bundles = {"torch-reference": reference, "torch (CPU default)": torch_ops}
        decodes = [(bs, ctx) for bs in (1, 8) for ctx in (512, 2048)]
        prefills = [(chunk, prefix) for chunk in (128, 512) for prefix in (0, 1024)]
        store_tokens, op_tokens = [128, 2048], 256
        name = "CPU"
        note = ("NO GPU FIGURES WERE TAKEN: CPU mode, torch ops at reduced shapes in float32, wall-clock times; "
                "the Triton kernels are not timed here.")

    rows = attention_rows(setup, attention_impls, decodes, prefills)
    rows += store_rows(setup, store_impls, store_tokens)
    for kernel, shape, call, moved in build_small_op_problems(setup, op_tokens):
        for impl, ops in bundles.items():
            seconds, error = timed(setup, lambda: call(ops))
            rows.append(Row(kernel, impl, shape, seconds, moved, 0.0, error))
    derive(rows, setup)
    if gpu:
        judge_targets(rows)

    import triton

    result = dict(device=name, gpu=gpu, note=note, torch=torch.__version__, triton=triton.__version__,
                  dtype=str(setup.dtype).removeprefix("torch."),
                  ceilings=dict(copy_GBps=copy_rate / 1e9, matmul_TFLOPs=matmul_rate / 1e12, how=how),
                  rows=[asdict(row) for row in rows])
    markdown = to_markdown(result)
    print(markdown)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown)
    return result


if __name__ == "__main__":
    main()
