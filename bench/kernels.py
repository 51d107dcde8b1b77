"""Kernel microbenchmarks judged against the kernel targets: time, achieved GB/s and TFLOP/s of every kernel, as
fractions of the device's copy bandwidth and bf16 matrix rate measured in the same run, beside torch's
scaled_dot_product_attention on the same problem gathered to contiguous form.

    python -m bench.kernels --out bench/results/kernels.json      # writes kernels.json and kernels.md
    POLYSERVE_ATTN_CONFIG=legacy python -m bench.kernels --attention-only --out /tmp/legacy.json
    python -m bench.kernels --report kernels.json [legacy.json]   # the judged summary [and both configs side by side]
    python -m bench.kernels --cpu                                  # CPU mode (also the default without a GPU)

GPU mode, Llama-3.1-8B attention shapes (32 query / 8 KV heads, head dim 128, block 16, bf16):
  - decode at batch 1/8/32/64/128/256, every context 4k, and contexts uniform over 1 to 8k;
  - prefill chunks of 512 and 2048 tokens over prefixes of 0 and 4k;
  - a mixed step: 64 decodes at 4k and one 512-token chunk over a 4k prefix, decodes first (as the engine
    schedules them);
  - the KV store at 128 and 16384 tokens; the fused small ops at 4096 tokens (hidden 4096, intermediate 14336).
Targets, on our kernels: decode at batch >= 64 moves >= 80 % of the copy bandwidth; chunk-2048 prefill runs at
>= 50 % of the bf16 matrix rate; the KV store at 16384 tokens moves >= 80 % of the copy bandwidth; and no attention
line is slower than SDPA where SDPA does the same work. SDPA runs the decode rows as one call (each KV head's
query heads as its queries, so no K/V copies for GQA) and each prefill chunk as a call of its own; where decode
contexts differ it pads them to the longest under a mask, more work than the problem's, so such a line shows the
ratio without judging it. Each time is the median over many runs between CUDA events, each run preceded by a 512
MiB write that evicts the L2 and keeps the GPU busy while the host enqueues the next launch, so times are device
times. Bytes are the unique bytes a kernel must move (K/V once, inputs read once, outputs written once); FLOPs
count 2 per multiply-add, causal keys only.

CPU mode: the torch ops (reference, the CPU default `torch` bundle, SDPA) at reduced shapes in float32, wall-clock
medians. No GPU figure comes from it, and the output says so; the Triton kernels are not timed (the interpreter's
speed means nothing) and no line is judged.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import get_ops
from kernels.paged_batch import PagedBatch, random_paged_batch
from kernels.reference import gather_kv

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GROUP = Q_HEADS // KV_HEADS
HIDDEN, INTERMEDIATE = 4096, 14336
TARGET_DECODE_BW, TARGET_PREFILL_MMA, TARGET_STORE_BW = 0.80, 0.50, 0.80
DECODE_TARGET_MIN_BATCH = 64


@dataclass(slots=True, frozen=True)
class Problem:
    """One attention batch: sequence i has contexts[i] cached tokens and q_lens[i] new ones; the first num_decodes
    sequences are decode rows. goal: ("bw" or "mma", fraction) where a target applies."""
    kind: str
    shape: str
    q_lens: list[int]
    contexts: list[int]
    num_decodes: int
    goal: tuple[str, float] | None = None


@dataclass(slots=True)
class Row:
    kernel: str
    impl: str
    shape: str
    seconds: float | None
    bytes: float
    flops: float
    note: str = ""
    goal: tuple[str, float] | None = None
    sdpa_seconds: float | None = None  # SDPA on this row's problem
    sdpa_exact: bool = False           # whether that SDPA call does exactly this problem's work
    verdict: str = ""                  # where judged: "met", "MISSED ..." per target
    derived: dict = field(default_factory=dict)


@dataclass(slots=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    timer: Callable[[Callable[[], object]], float]
    copy_bytes_per_s: float
    matmul_flops_per_s: float


# ---- timing ---------------------------------------------------------------------------------------------------

def cuda_timer(min_seconds: float = 0.1, max_runs: int = 200) -> Callable:
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

def gpu_problems() -> list[Problem]:
    rng = random.Random(0)
    problems = []
    for bs in (1, 8, 32, 64, 128, 256):
        goal = ("bw", TARGET_DECODE_BW) if bs >= DECODE_TARGET_MIN_BATCH else None
        problems.append(Problem("decode", f"bs={bs} ctx=4k", [1] * bs, [4095] * bs, bs, goal))
        problems.append(Problem("decode", f"bs={bs} ctx=U(1,8k)", [1] * bs,
                                [rng.randint(1, 8192) - 1 for _ in range(bs)], bs, goal))
    for chunk in (512, 2048):
        for prefix in (0, 4096):
            goal = ("mma", TARGET_PREFILL_MMA) if chunk == 2048 else None
            problems.append(Problem("prefill", f"chunk={chunk} prefix={prefix}", [chunk], [prefix], 0, goal))
    problems.append(Problem("mixed", "64 decodes ctx=4k + chunk=512 prefix=4k", [1] * 64 + [512],
                            [4095] * 64 + [4096], 64))
    return problems


def cpu_problems() -> list[Problem]:
    rng = random.Random(0)
    problems = []
    for bs in (1, 8):
        problems.append(Problem("decode", f"bs={bs} ctx=512", [1] * bs, [511] * bs, bs))
        problems.append(Problem("decode", f"bs={bs} ctx=U(1,1k)", [1] * bs,
                                [rng.randint(1, 1024) - 1 for _ in range(bs)], bs))
    for chunk in (128, 512):
        for prefix in (0, 1024):
            problems.append(Problem("prefill", f"chunk={chunk} prefix={prefix}", [chunk], [prefix], 0))
    problems.append(Problem("mixed", "8 decodes ctx=512 + chunk=128 prefix=512", [1] * 8 + [128],
                            [511] * 8 + [512], 8))
    return problems


def attention_bytes(batch: PagedBatch) -> float:
    element = batch.q.element_size()
    kv = 2 * sum(q + c for q, c in zip(batch.q_lens, batch.context_lens)) * KV_HEADS * HEAD_DIM * element
    return kv + 2 * batch.q.numel() * element  # + q read and out written


def attention_flops(batch: PagedBatch) -> float:
    return 4.0 * batch.keys_seen() * Q_HEADS * HEAD_DIM


def sdpa_baseline(batch: PagedBatch, num_decodes: int) -> tuple[Callable[[], object], bool]:
    """torch SDPA on the batch gathered to contiguous tensors, and whether it does exactly the batch's work.

    The decode rows are one call whose queries are each KV head's query heads ([n, kv heads, group, D] against
    [n, kv heads, L, D]): GQA without copying K/V. Where their contexts differ they are padded to the longest and
    masked. Each prefill sequence is a call of its own, causal with its queries aligned to the end of its keys."""
    lengths = batch.seq_lens.tolist()
    calls = []
    exact = True
    if num_decodes:
        longest = max(lengths[:num_decodes])
        shape = (num_decodes, KV_HEADS, longest, HEAD_DIM)
        k = torch.zeros(shape, dtype=batch.q.dtype, device=batch.q.device)
        v = torch.zeros(shape, dtype=batch.q.dtype, device=batch.q.device)
        for i, n in enumerate(lengths[:num_decodes]):
            k[i, :, :n] = gather_kv(batch.k_cache, batch.block_tables[i], n).transpose(0, 1)
            v[i, :, :n] = gather_kv(batch.v_cache, batch.block_tables[i], n).transpose(0, 1)
        q = batch.q[:num_decodes].reshape(num_decodes, KV_HEADS, GROUP, HEAD_DIM)
        mask = None
        if min(lengths[:num_decodes]) != longest:
            exact = False
            positions = torch.arange(longest, device=batch.q.device)
            mask = (positions[None, :] < batch.seq_lens[:num_decodes, None]).view(num_decodes, 1, 1, longest)
        calls.append(decode_sdpa(q, k, v, mask, batch.scale))
    starts = batch.query_start_loc.tolist()
    for i in range(num_decodes, len(lengths)):
        q = batch.q[starts[i]:starts[i + 1]].unsqueeze(0).transpose(1, 2).contiguous()
        k = gather_kv(batch.k_cache, batch.block_tables[i], lengths[i]).unsqueeze(0).transpose(1, 2).contiguous()
        v = gather_kv(batch.v_cache, batch.block_tables[i], lengths[i]).unsqueeze(0).transpose(1, 2).contiguous()
        calls.append(causal_sdpa(q, k, v, batch.scale))

    return lambda: [call() for call in calls], exact


def decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> Callable[[], torch.Tensor]:
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
    """Causal with the queries aligned to the end of the keys (the chunked-prefill alignment)."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if q_len == kv_len:
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


def progress(row: Row) -> None:
    figure = "failed" if row.seconds is None else f"{row.seconds * 1e6:.1f} us"
    print(f"  {row.kernel} | {row.impl} | {row.shape}: {figure} {row.note}", file=sys.stderr, flush=True)


def attention_rows(setup: Setup, impls: dict[str, Callable], problems: list[Problem]) -> list[Row]:
    rows = []
    for problem in problems:
        batch = random_paged_batch(problem.q_lens, problem.contexts, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                   setup.dtype, setup.device, poison_unused=False)
        hints = dict(max_query_len=max(problem.q_lens), num_decodes=problem.num_decodes,
                     max_seq_len=max(q + c for q, c in zip(problem.q_lens, problem.contexts)))
        kernel = f"attention-{problem.kind}"
        moved, flops = attention_bytes(batch), attention_flops(batch)
        sdpa, exact = sdpa_baseline(batch, problem.num_decodes)
        sdpa_seconds, sdpa_note = timed(setup, sdpa)
        problem_rows = []
        for impl, attend in impls.items():
            seconds, note = timed(setup, lambda: attend(*batch.attention_args(), **hints))
            problem_rows.append(Row(kernel, impl, problem.shape, seconds, moved, flops, note, problem.goal,
                                    sdpa_seconds, exact))
        padding = "" if exact else "padded to the longest context, masked"
        problem_rows.append(Row(kernel, "torch-sdpa (contiguous)", problem.shape, sdpa_seconds, moved, flops,
                                sdpa_note or padding))
        for row in problem_rows:
            progress(row)
        rows += problem_rows
        del batch, sdpa
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def store_rows(setup: Setup, impls: dict[str, Callable], token_counts: list[int], judged: int | None) -> list[Row]:
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
        goal = ("bw", TARGET_STORE_BW) if tokens == judged else None
        for impl, store in impls.items():
            seconds, note = timed(setup, lambda: store(k, v, k_cache, v_cache, slots))
            rows.append(Row("kv-store", impl, f"tokens={tokens}", seconds, moved, 0.0, note, goal))
            progress(rows[-1])
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


# ---- judging and reporting ------------------------------------------------------------------------------------

def derive(rows: list[Row], setup: Setup) -> None:
    for row in rows:
        if row.seconds is None:
            continue
        bandwidth, rate = row.bytes / row.seconds, row.flops / row.seconds
        row.derived = dict(time_us=row.seconds * 1e6, GBps=bandwidth / 1e9, TFLOPs=rate / 1e12,
                           bw_fraction=bandwidth / setup.copy_bytes_per_s,
                           mma_fraction=rate / setup.matmul_flops_per_s)


def judge(rows: list[Row]) -> None:
    """The verdict of every line of our kernels that a target covers: its fraction of the ceiling against the goal,
    and its time against SDPA's where SDPA does the same work."""
    for row in rows:
        if row.impl.startswith("torch"):
            continue
        parts = []
        if row.seconds is None:
            parts.append("MISSED (did not run)")
        else:
            if row.goal is not None:
                metric, goal = row.goal
                fraction = row.derived["bw_fraction" if metric == "bw" else "mma_fraction"]
                name = "copy BW" if metric == "bw" else "bf16 MMA"
                parts.append(f"{'met' if fraction >= goal else 'MISSED'}: {fraction:.0%} of {name} (goal {goal:.0%})")
            if row.sdpa_seconds is not None and row.sdpa_exact:
                speedup = row.sdpa_seconds / row.seconds
                parts.append(f"{'met' if speedup >= 1.0 else 'MISSED'}: {speedup:.2f}x SDPA's speed (goal 1x)")
        row.verdict = "; ".join(parts)


def sdpa_column(row: dict) -> str:
    if row["sdpa_seconds"] is None or row["seconds"] is None or row["impl"].startswith("torch-sdpa"):
        return "-"
    return f"{row['sdpa_seconds'] / row['seconds']:.2f}x{'' if row['sdpa_exact'] else ' (padded)'}"


def figures(row: dict) -> str:
    d = row["derived"]
    if not d:
        return "- | - | - | - | -"
    return (f"{d['time_us']:.1f} | {d['GBps']:.1f} | {d['TFLOPs']:.2f} | {100 * d['bw_fraction']:.1f} | "
            f"{100 * d['mma_fraction']:.1f}")


def header(result: dict) -> list[str]:
    ceilings = result["ceilings"]
    return [f"Ceilings measured in this run ({ceilings['how']}): copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul "
            f"{ceilings['matmul_TFLOPs']:.1f} TFLOP/s. torch {result['torch']}, triton {result['triton']}, dtype "
            f"{result['dtype']}, attention tile config {result['attention_config']}.", ""]


def to_markdown(result: dict) -> str:
    lines = [f"# Kernel microbenchmarks: {result['device']}", "", result["note"], "", *header(result),
             "| kernel | impl | shape | time (us) | GB/s | TFLOP/s | % copy BW | % bf16 MMA | SDPA time / ours | "
             "verdict | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['kernel']} | {row['impl']} | {row['shape']} | {figures(row)} | {sdpa_column(row)} | "
                     f"{row['verdict']} | {row['note']} |")
    return "\n".join(lines) + "\n"


def summary(result: dict, other: dict | None = None) -> str:
    """The judged lines of `result` (met / missed per target), and where `other` is a run of another attention
    tile configuration, the two configurations' attention times side by side."""
    judged = [row for row in result["rows"] if row["verdict"]]
    missed = [row for row in judged if "MISSED" in row["verdict"]]
    lines = [f"## Targets: {result['device']}, attention tile config {result['attention_config']}", "",
             *header(result),
             "| kernel | impl | shape | time (us) | GB/s | TFLOP/s | % copy BW | % bf16 MMA | SDPA time / ours | "
             "verdict |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in judged:
        lines.append(f"| {row['kernel']} | {row['impl']} | {row['shape']} | {figures(row)} | {sdpa_column(row)} | "
                     f"{row['verdict']} |")
    lines += ["", f"{len(judged) - len(missed)} of {len(judged)} judged lines meet every target"
                  f"{'' if result['gpu'] else ' (CPU run: nothing is judged)'}."]
    if other is not None:
        theirs = {(r["kernel"], r["impl"], r["shape"]): r for r in other["rows"]}
        lines += ["", f"## Attention tile configs: {result['attention_config']} against {other['attention_config']}",
                  "", f"| kernel | shape | {result['attention_config']} (us) | {other['attention_config']} (us) | "
                      f"faster |", "|---|---|---:|---:|---|"]
        wins = {result["attention_config"]: 0, other["attention_config"]: 0}
        for row in result["rows"]:
            twin = theirs.get((row["kernel"], row["impl"], row["shape"]))
            if not row["kernel"].startswith("attention") or row["impl"] != "triton" or twin is None:
                continue
            if row["seconds"] is None or twin["seconds"] is None:
                lines.append(f"| {row['kernel']} | {row['shape']} | {row['seconds']} | {twin['seconds']} | - |")
                continue
            faster = result["attention_config"] if row["seconds"] <= twin["seconds"] else other["attention_config"]
            wins[faster] += 1
            lines.append(f"| {row['kernel']} | {row['shape']} | {row['seconds'] * 1e6:.1f} | "
                         f"{twin['seconds'] * 1e6:.1f} | {faster} |")
        lines += ["", "Faster on " + ", ".join(f"{name}: {count} lines" for name, count in wins.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON results path; the markdown table goes beside it (.md)")
    parser.add_argument("--cpu", action="store_true", help="CPU mode even where a GPU is present")
    parser.add_argument("--attention-only", action="store_true", help="only the attention lines")
    parser.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                        help="print the judged summary of a results file (and beside it the attention times of a "
                             "second one, of another tile config); measures nothing")
    args = parser.parse_args(argv)
    if args.report:
        if len(args.report) > 2:
            parser.error("--report takes one or two results files")
        results = [json.loads(path.read_text()) for path in args.report]
        print(summary(*results))
        return None

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
            store_impls["cuda-c++"] = cuda_ops.store_kvcache
            cuda_note = ""
        except ImportError as error:
            cuda_note = f" CUDA C++ KV store not timed: {error}."
        problems, store_tokens, judged_store, op_tokens = gpu_problems(), [128, 16384], 16384, 4096
        name = torch.cuda.get_device_name()
        note = f"GPU figures, device times (CUDA events).{cuda_note}"
        attention_config = getattr(sys.modules.get("kernels.attention"), "TILE_CONFIG", "default")
    else:
        reference, torch_ops = get_ops("cpu", backend="reference"), get_ops("cpu")
        attention_impls = {"torch-reference": reference.paged_attention,
                           "torch (CPU default)": torch_ops.paged_attention}
        store_impls = {"torch-reference": reference.store_kvcache, "torch (CPU default)": torch_ops.store_kvcache}
        bundles = {"torch-reference": reference, "torch (CPU default)": torch_ops}
        problems, store_tokens, judged_store, op_tokens = cpu_problems(), [128, 2048], None, 256
        name = "CPU"
        note = ("NO GPU FIGURES WERE TAKEN: CPU mode, torch ops at reduced shapes in float32, wall-clock times; "
                "the Triton kernels are not timed here and no line is judged.")
        attention_config = "not used on the CPU"

    rows = attention_rows(setup, attention_impls, problems)
    if not args.attention_only:
        rows += store_rows(setup, store_impls, store_tokens, judged_store)
        for kernel, shape, call, moved in build_small_op_problems(setup, op_tokens):
            for impl, ops in bundles.items():
                seconds, error = timed(setup, lambda: call(ops))
                rows.append(Row(kernel, impl, shape, seconds, moved, 0.0, error))
                progress(rows[-1])
    derive(rows, setup)
    if gpu:
        judge(rows)

    import triton

    result = dict(device=name, gpu=gpu, note=note, torch=torch.__version__, triton=triton.__version__,
                  dtype=str(setup.dtype).removeprefix("torch."), attention_config=attention_config,
                  ceilings=dict(copy_GBps=copy_rate / 1e9, matmul_TFLOPs=matmul_rate / 1e12, how=how),
                  rows=[asdict(row) for row in rows])
    print(to_markdown(result))
    print(summary(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(to_markdown(result))
    return result


if __name__ == "__main__":
    main()
