"""Compile the Triton kernels for Hopper (sm_90) on a machine without a GPU, and report what the compiler made.

    python -m kernels.compile_check                  # a table
    python -m kernels.compile_check --json           # one JSON object per compiled kernel
    POLYSERVE_ATTN_CONFIG=legacy python -m kernels.compile_check   # the attention's previous tile configuration

Triton needs an active driver only to name the target; a stand-in that names sm_90 lets every launch go through
Triton's own argument binding and specialisation in warm-up mode (compile, never launch). For each kernel the
report gives ptxas's registers and spill stores, the shared memory, the thread blocks one multiprocessor can hold
at those, whether the products became Hopper wgmma (`warp_group_dot` in the TTGIR) and how the loads were
software-pipelined: the buffers of each multi-buffered tile (the leading dimension of the pipeliner's shared-memory
allocations) and whether any iteration waits for only some of the copies in flight (`ttg.async_wait` with a
nonzero count) rather than all of them.
It must run in its own process with TRITON_INTERPRET unset: the stand-in driver replaces the real one.
The shapes are the production ones: every attention launch the engine makes for Llama-3.1-8B (32 query / 8 KV
heads, head dim 128, bf16, block 16) — decode, prefill and mixed steps, with and without split-KV.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class _Sm90Target:
    """The part of Triton's driver interface that compiling (not launching) uses."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) from the ptxas bundled with Triton; the PTX targets sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", source.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    registers = int(re.search(r"Used (\d+) registers", result.stderr).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", result.stderr).group(1))
    return registers, spills


# Hopper's per-multiprocessor budget: registers, shared memory (of which one block may use 227 KB; each resident
# block also costs 1 KB the runtime reserves), threads.
SM90_REGISTERS = 65536
SM90_SHARED_BYTES = 228 * 1024
SM90_SHARED_BYTES_PER_BLOCK = 227 * 1024
SM90_RESERVED_SHARED_PER_BLOCK = 1024
SM90_THREADS = 2048
H200_MULTIPROCESSORS = 132


def blocks_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Thread blocks of this kernel one sm_90 multiprocessor holds at once (registers go by warp, in 256s)."""
    registers_per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90_REGISTERS // (registers_per_warp * num_warps)
    by_shared = SM90_SHARED_BYTES // (shared_bytes + SM90_RESERVED_SHARED_PER_BLOCK)
    return min(by_registers, by_shared, SM90_THREADS // (32 * num_warps))


def pipelining(ttgir: str) -> tuple[list[int], int, int]:
    """(buffers of each multi-buffered tile, waits for only some copies, waits for all) in a kernel's TTGIR.

    The pipeliner allocates a tile's buffers as one mutable shared-memory array with the buffer count as its
    leading dimension (`ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, ...>`); an iteration then waits with
    `ttg.async_wait {num = k}` until at most k copy groups are still in flight, k = 0 waiting for all."""
    buffers = [int(count) for count, shape in
               re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x(\d+x\d+)x", ttgir)]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait\b[^\n]*\{num = (\d+)", ttgir)]
    return buffers, sum(n > 0 for n in waits), sum(n == 0 for n in waits)


def _production_launches() -> list[tuple[str, callable, bool]]:
    """(label, the launch, whether its attention tiles must be software-pipelined). The long decode tile is not:
    on an H200 it streams large batches fastest single-buffered, two blocks per multiprocessor overlapping each
    other's loads (bench/RESULTS.md), where deeper pipelining costs it that second block."""
    from kernels import activation, attention, kv_store, norm, rotary
    from kernels.dispatch import leading_decodes
    from kernels.paged_batch import random_paged_batch

    # Eager steps choose their split count from the device's multiprocessors: those of an H200.
    attention.num_sms = lambda device: H200_MULTIPROCESSORS

    def attend(label, q_lens, contexts, q_heads, kv_heads, head_dim, dtype, max_seq_len, pipelined=True):
        """The attention as the model runner calls it for a step of these query lengths (decode rows first): its
        hints, with a longest context of `max_seq_len`, which decides whether the decode rows split their keys."""
        batch = random_paged_batch(q_lens, contexts, q_heads, kv_heads, head_dim, 16, dtype, "cpu",
                                   poison_unused=False)
        num_decodes = leading_decodes(torch.tensor(q_lens))
        return label, lambda: attention.paged_attention(*batch.attention_args(), max_query_len=max(q_lens),
                                                        max_seq_len=max_seq_len, num_decodes=num_decodes), pipelined

    bf16 = torch.bfloat16
    x = torch.randn(4, 4096, dtype=bf16)
    qkv = torch.randn(4, 48 * 128, dtype=bf16)
    k = torch.randn(4, 8, 128, dtype=bf16)
    cache = torch.zeros(2, 16, 8, 128, dtype=bf16)
    decodes, contexts = [1] * 4, [90, 30, 7, 2]
    short, long = 256, 8192  # the longest context of the step: no split below 2 x MIN_KEYS_PER_SPLIT
    long_decodes = [1] * attention.LONG_DECODE_MIN_SEQS
    long_contexts = (contexts * attention.LONG_DECODE_MIN_SEQS)[:attention.LONG_DECODE_MIN_SEQS]
    return [
        attend("attention decode bf16 d128 group4", decodes, contexts, 32, 8, 128, bf16, short),
        attend("attention decode bf16 d128 group4 split-KV", decodes, contexts, 32, 8, 128, bf16, long),
        attend("attention decode bf16 d128 group4 long tile", long_decodes, long_contexts, 32, 8, 128, bf16, short,
               pipelined=False),
        attend("attention decode bf16 d128 group4 long tile split-KV", long_decodes, long_contexts, 32, 8, 128, bf16,
               long, pipelined=False),
        attend("attention prefill bf16 d128 group4", [40, 7], [9, 3], 32, 8, 128, bf16, long),
        attend("attention mixed bf16 d128 group4", decodes + [40], contexts + [3], 32, 8, 128, bf16, short),
        attend("attention mixed bf16 d128 group4 split-KV", decodes + [40], contexts + [3], 32, 8, 128, bf16, long),
        attend("attention prefill fp16 d64 group8", [40, 7], [9, 3], 32, 4, 64, torch.float16, long),
        ("kv store bf16", lambda: kv_store.store_kvcache(k, k, cache, cache.clone(), torch.arange(4)), False),
        ("rms norm bf16", lambda: norm.rms_norm(x, x[0], 1e-5), False),
        ("fused add rms norm bf16", lambda: norm.fused_add_rms_norm(x, x, x[0], 1e-5), False),
        ("rotary bf16", lambda: rotary.rotary_embedding(qkv[:, :4096].view(4, 32, 128),
                                                        qkv[:, 4096:5120].view(4, 8, 128), torch.arange(4),
                                                        torch.randn(8, 128)), False),
        ("silu and mul bf16", lambda: activation.silu_and_mul(torch.randn(4, 2 * 14336, dtype=bf16)), False),
    ]


def compile_all() -> list[dict]:
    if triton.knobs.runtime.interpret:
        raise RuntimeError("run with TRITON_INTERPRET unset: the interpreter compiles nothing")
    driver.set_active(_Sm90Target())
    compiled: list = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    reports = []
    for label, call, pipelined in _production_launches():
        compiled.clear()
        call()
        for name, kernel in compiled:
            registers, spills = _ptxas_report(kernel.asm["ptx"])
            ttgir = kernel.asm["ttgir"]
            buffers, partial_waits, full_waits = pipelining(ttgir)
            meta = kernel.metadata
            reports.append(dict(launch=label, kernel=name, registers=registers, spill_bytes=spills,
                                shared_bytes=meta.shared, num_warps=meta.num_warps, num_stages=meta.num_stages,
                                blocks_per_sm=blocks_per_sm(registers, meta.shared, meta.num_warps),
                                wgmma="warp_group_dot" in ttgir, async_copies="async_copy_global_to_local" in ttgir,
                                tile_buffers=buffers, partial_waits=partial_waits, full_waits=full_waits,
                                pipelined=pipelined))
    return reports


def problems(reports: list[dict], tile_config: str) -> list[str]:
    """What in the compiled kernels would hurt on a GPU: register spills, shared memory past a block's limit, and
    (under the pipelined attention tiles) attention tiles meant to be pipelined that are not multi-buffered or wait
    for every copy."""
    found = []
    for r in reports:
        where = f"{r['launch']}: {r['kernel']}"
        if r["spill_bytes"]:
            found.append(f"{where} spills {r['spill_bytes']} bytes of registers")
        if r["shared_bytes"] > SM90_SHARED_BYTES_PER_BLOCK:
            found.append(f"{where} needs {r['shared_bytes']} bytes of shared memory per block")
        if r["kernel"] == "_paged_attention_kernel" and tile_config == "pipelined" and r["pipelined"]:
            if min(r["tile_buffers"], default=0) < 2:
                found.append(f"{where} has K/V tiles with buffers {r['tile_buffers']}, not multi-buffered")
            if not r["partial_waits"]:
                found.append(f"{where} waits for all its copies at every wait")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description="compile the Triton kernels for sm_90 without a GPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reports = compile_all()
    if args.json:
        print(json.dumps(reports))
        return
    from kernels.attention import TILE_CONFIG

    print(f"attention tile configuration: {TILE_CONFIG}")
    print(f"{'launch':52s} {'kernel':23s} regs spill  smem KB warps stages CTA/SM wgmma buffers partial/all waits")
    for r in reports:
        buffers = ",".join(map(str, r["tile_buffers"])) or "-"
        print(f"{r['launch']:52s} {r['kernel']:23s} {r['registers']:4d} {r['spill_bytes']:5d} "
              f"{r['shared_bytes'] / 1024:8.1f} {r['num_warps']:5d} {r['num_stages']:6d} {r['blocks_per_sm']:6d} "
              f"{str(r['wgmma']):5s} {buffers:7s} {r['partial_waits']}/{r['full_waits']}")
    found = problems(reports, TILE_CONFIG)
    for problem in found:
        print(f"problem: {problem}")
    if found:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
