"""Serving never recompiles a Triton kernel: every launch's compile key is fixed by its constexpr configuration.

Triton compiles a kernel once per key: the constexpr arguments, the launch options (warps, stages) and what it
specialises on among the runtime arguments (an int equal to 1 or divisible by 16, a pointer aligned to 16 bytes).
A runtime int that changes from step to step (a batch size, a block-table width) multiplies the compiles, each a
multi-second stall on a GPU in the middle of serving. These tests record every launch the engine (or the attention
entry) makes over runs of varying batch sizes, contexts and block-table widths, compute each launch's key with
Triton's own argument binder for an sm_90 target (what `JITFunction.run` computes before looking up its cache; no
GPU needed), and check that there is exactly one key per constexpr configuration.

The kernels run in Triton's interpreter (set up by conftest before any kernel module is imported). The last test
checks the warning the engine logs when a kernel compiles after its warm-up.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import triton

from kernels import attention, kv_store
from kernels.paged_batch import random_paged_batch

ROOT = Path(__file__).resolve().parents[1]

# Triton's interpreter converts a one-element array to an int when a loop bound is a tensor (its own code).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
interpreted = pytest.mark.skipif(not attention.INTERPRETED, reason="records launches through Triton's interpreter")


class LaunchKeys:
    """Per kernel: each launch's compile key, its constexpr configuration and the argument values seen."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders: dict = {}
        # name -> constexpr configuration -> compile key -> the specialisation of each argument
        self.keys: dict[str, dict[tuple, dict[str, list]]] = defaultdict(lambda: defaultdict(dict))
        self.args: dict[str, list[dict]] = defaultdict(list)
        self.run = True  # False: record the launches without running them

    def record(self, kernel, args: tuple, kwargs: dict) -> None:
        from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

        name = kernel.fn.__name__
        if name not in self.binders:
            jit = JITFunction(kernel.fn, **kernel.kwargs)  # the decorator's own do_not_specialize & co.
            self.binders[name] = (jit, create_function_from_signature(jit.signature, jit.params, self.backend))
        jit, binder = self.binders[name]
        bound, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key({}, specialization, options)
        config = (tuple(value for param, value in zip(jit.params, bound.values()) if param.is_constexpr),
                  tuple(sorted(options.items())))
        self.keys[name][config][key] = specialization
        self.args[name].append({**bound, **options})  # the arguments and the launch options (warps, stages)

    def assert_one_key_per_config(self) -> None:
        for name, by_config in self.keys.items():
            for config, keys in by_config.items():
                assert len(keys) == 1, (f"{name} compiles {len(keys)} variants for one constexpr configuration; "
                                        f"specialised on: {self.varying_specialisations(name, keys.values())}")

    def varying_specialisations(self, name: str, specialisations) -> dict[str, set[str]]:
        """The parameters whose specialisation differs between launches, with what each was specialised to."""
        jit, _ = self.binders[name]
        seen = {param.name: {str(spec[i]) for spec in specialisations} for i, param in enumerate(jit.params)}
        return {param: values for param, values in seen.items() if len(values) > 1}

    def configs(self) -> set[tuple[str, tuple]]:
        """(kernel, constexpr configuration) of every launch so far: the variants compiled."""
        return {(name, config) for name, by_config in self.keys.items() for config in by_config}

    def values(self, name: str, arg: str) -> set:
        """The values `arg` took over the launches of kernel `name` (of the block table: its width)."""
        return {a[arg].shape[1] if arg == "block_tables_ptr" else a[arg] for a in self.args[name]}


@pytest.fixture
def launches(monkeypatch):
    """Records every kernel launch (and still runs it, or skips running it when `launches.run` is False)."""
    from triton.runtime.interpreter import InterpretedFunction

    recorder = LaunchKeys()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        recorder.record(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs) if recorder.run else None

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return recorder


@interpreted
def test_engine_run_compiles_one_variant_per_tile_configuration(llama_tiny, launches, monkeypatch):
    """A bf16 engine on the Triton kernels serves prompts of many lengths in chunks, so its steps mix prefill and
    decode rows, shrink and grow in batch size and block-table width (1 to 34 blocks of 16), and split the keys
    of its long decodes, as on an H200, and its decode launches take both tile lengths (the long one from four
    rows here, so that the interpreter can afford it). Every variant the run launches was compiled at start-up
    (the model runner's warm-up), and each has one key."""
    from engine import LLM, SamplingParams

    monkeypatch.setattr(attention, "num_sms", lambda device: 132)  # an H200: eager decodes choose split-KV
    monkeypatch.setattr(attention, "LONG_DECODE_MIN_SEQS", 4)
    # On a GPU the step's metadata reach the kernels as fresh device allocations (`.to(device)`; the caching
    # allocator aligns them to 512 bytes); on the CPU `.to("cpu")` hands over the host batch buffers themselves,
    # at whatever offset the C++ side placed them. A copy stands in for the device allocation.
    from_numpy = torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda array: from_numpy(array).clone())
    folder, hf = llama_tiny
    llm = LLM(folder, kernels="triton", dtype="bfloat16", max_num_batched_tokens=64, num_kv_blocks=128,
              batch_policy="fcfs", enable_prefix_caching=False)
    compiled_at_start = launches.configs()
    generator = torch.Generator().manual_seed(3)
    lengths, outputs = [2, 9, 40, 17, 1, 75, 30, 540], [12, 3, 8, 20, 5, 2, 14, 4]
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == outputs

    assert {"_paged_attention_kernel", "_merge_splits_kernel", "_store_kvcache_kernel", "_rms_norm_kernel",
            "_rotary_kernel", "_silu_and_mul_kernel"} <= set(launches.keys)
    widths = launches.values("_paged_attention_kernel", "block_tables_ptr")
    assert {1, 2, 3, 34} <= widths and len(widths) >= 8, widths  # the run varied what could specialise
    assert len(launches.values("_paged_attention_kernel", "num_seqs")) >= 4
    assert len(launches.values("_paged_attention_kernel", "num_splits")) >= 2
    assert len(launches.values("_store_kvcache_kernel", "stride_k_token")) == 1  # a per-model constant, specialised
    decode_tiles = {(a["num_seqs"] >= 4, a["BLOCK_N"], a["num_stages"])
                    for a in launches.args["_paged_attention_kernel"] if a["SINGLE_QUERY"]}
    assert len({(n, stages) for long_tile, n, stages in decode_tiles if long_tile}) == 1, decode_tiles
    assert len({(n, stages) for _, n, stages in decode_tiles}) == 2, decode_tiles
    launches.assert_one_key_per_config()
    assert launches.configs() == compiled_at_start


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_and_store_launches_compile_one_variant_per_tile_configuration(launches, dtype):
    """The attention entry and the KV store over a sweep of batch sizes, table widths (contiguous tables of 1 to 40
    blocks, as the engine builds them per step) and split counts, at Llama-3.1-8B head counts (launches recorded,
    not run: the keys do not depend on tensor contents)."""
    launches.run = False
    q_heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    # (query lengths, contexts, block-table width: at least the longest sequence's blocks, as the engine pads)
    cases = [([1], [0], 1), ([1], [15], 1), ([1] * 3, [16, 40, 300], 19), ([1] * 17, [7] * 17, 16),
             ([1] * 32, [620] * 32, 40), ([5, 1], [0, 200], 13), ([40], [0], 3), ([16, 1, 1], [31, 63, 5], 17)]
    for q_lens, contexts, width in cases:
        batch = random_paged_batch(q_lens, contexts, q_heads, kv_heads, head_dim, block_size, dtype, "cpu",
                                   spare_blocks=0, poison_unused=False)
        tables = torch.zeros((len(q_lens), width), dtype=torch.int32)
        used = min(width, batch.block_tables.shape[1])
        tables[:, :used] = batch.block_tables[:, :used]
        for num_splits in (1, 2, 7):
            decode = all(q == 1 for q in q_lens)
            attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens,
                                      batch.query_start_loc, batch.scale, max_query_len=max(q_lens),
                                      num_splits=num_splits if decode else None)
        k = torch.randn(len(q_lens) * 3, kv_heads, head_dim, dtype=dtype)
        kv_store.store_kvcache(k, k, batch.k_cache, batch.v_cache, torch.arange(len(k)))

    assert {1, 16, 17, 40} <= launches.values("_paged_attention_kernel", "block_tables_ptr")
    assert {1, 2, 3, 17, 32} <= launches.values("_paged_attention_kernel", "num_seqs")
    assert {"_paged_attention_kernel", "_store_kvcache_kernel"} <= set(launches.keys)
    assert "_merge_splits_kernel" in launches.keys
    launches.assert_one_key_per_config()


WARNING_SCRIPT = """
import logging
import sys
import torch
from triton.runtime import driver
from kernels.compile_check import _Sm90Target

driver.set_active(_Sm90Target())  # compiles for sm_90 without a GPU; warmup() compiles and never launches
from engine.model_runner import kernels_compiling
from kernels.kv_store import _store_kvcache_kernel

logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")


def compile_store(head_dim):
    k = torch.zeros(4, 8, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 8, head_dim, dtype=torch.bfloat16)
    _store_kvcache_kernel.warmup(k, k, cache, cache, torch.arange(4), *k.stride()[:2], *k.stride()[:2],
                                 *cache.stride()[:3], *cache.stride()[:3], NUM_KV_HEADS=8, HEAD_DIM=head_dim,
                                 BLOCK_D=head_dim, BLOCK_SIZE=16, HEADS_PER_PROGRAM=8, grid=(4, 1))


with kernels_compiling():
    compile_store(128)
print("warm-up done", flush=True)
compile_store(128)  # compiled already: no compile, no warning
print("same variant done", flush=True)
compile_store(64)
print("new variant done", flush=True)
"""


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
                    reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_a_compile_after_warm_up_logs_a_warning():
    """The engine's hook, installed by the model runner's warm-up, through a real compile for sm_90 (in its own
    process: the stand-in driver replaces Triton's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", WARNING_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines()
             if line.startswith(("WARNING engine.model_runner", "warm-up", "same variant", "new variant"))]
    assert len(lines) == 4 and lines[:2] == ["warm-up done", "same variant done"], lines
    # the new head size is a new variant: its compile is named, with the key that shows what it specialised on
    assert lines[2].startswith("WARNING engine.model_runner Triton compiled _store_kvcache_kernel after warm-up"), lines
    assert "('constexpr', 64)" in lines[2], lines
    assert lines[3] == "new variant done", lines
