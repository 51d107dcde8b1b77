"""What can be checked of the GPU code without a GPU: the Triton kernels compile for Hopper (sm_90) into code
without register spills, the prefill products become wgmma and the attention's K/V loads are software-pipelined
(several buffers per tile, waits for only some of the copies in flight); the CUDA C++ sources compile with nvcc for
sm_90. Both run in subprocesses (the Triton check swaps Triton's driver)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvidia_backend_present() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def compile_reports(tile_config: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["POLYSERVE_ATTN_CONFIG"] = tile_config
    result = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def attention_reports(reports: list[dict], kind: str) -> list[dict]:
    return [r for r in reports if r["kernel"] == "_paged_attention_kernel" and r["launch"].startswith(kind)]


@pytest.mark.skipif(not _nvidia_backend_present(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_triton_kernels_compile_for_sm90_without_spills_and_pipelined():
    from kernels.compile_check import SM90_SHARED_BYTES_PER_BLOCK, problems

    reports = compile_reports("pipelined")
    kernels = {r["kernel"] for r in reports}
    assert {"_paged_attention_kernel", "_merge_splits_kernel", "_store_kvcache_kernel", "_rms_norm_kernel",
            "_rotary_kernel", "_silu_and_mul_kernel"} <= kernels
    for r in reports:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= SM90_SHARED_BYTES_PER_BLOCK, r
        assert r["blocks_per_sm"] >= 1, r
    # every attention launch the engine makes at Llama-3.1-8B shapes: decode and mixed steps with and without
    # split-KV (a mixed step is a decode-tile launch and a prefill-tile one), prefill steps
    for kind in ("attention decode", "attention prefill", "attention mixed"):
        assert attention_reports(reports, kind), kind
    for kind in ("attention decode bf16 d128 group4 split-KV", "attention mixed bf16 d128 group4 split-KV"):
        assert any(r["kernel"] == "_merge_splits_kernel" and r["launch"] == kind for r in reports), kind
    assert not any(r["kernel"] == "_merge_splits_kernel" and "split-KV" not in r["launch"] for r in reports)
    for r in attention_reports(reports, "attention"):
        if r["pipelined"]:
            assert len(r["tile_buffers"]) >= 2 and min(r["tile_buffers"]) >= 2, r  # K and V, each multi-buffered
            assert r["partial_waits"] >= 1, r
    # the long decode tile of large decode launches: single-buffered, for two blocks per multiprocessor
    long_tiles = [r for r in attention_reports(reports, "attention decode") if not r["pipelined"]]
    assert long_tiles and all(r["blocks_per_sm"] >= 2 for r in long_tiles), long_tiles
    assert all(not r["wgmma"] for r in attention_reports(reports, "attention decode"))
    assert all(r["wgmma"] for r in attention_reports(reports, "attention prefill"))
    for launch in {r["launch"] for r in attention_reports(reports, "attention mixed")}:
        assert sorted(r["wgmma"] for r in reports
                      if r["launch"] == launch and r["kernel"] == "_paged_attention_kernel") == [False, True]
    assert problems(reports, "pipelined") == []


@pytest.mark.skipif(not _nvidia_backend_present(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_legacy_tile_configuration_stays_selectable_and_the_check_sees_it_unpipelined():
    """The previous configuration, kept for a GPU run to measure against: single-buffered decode tiles and every
    wait a wait for all copies, which the compile check reports as problems of a pipelined configuration."""
    from kernels.compile_check import problems

    reports = compile_reports("legacy")
    decode = attention_reports(reports, "attention decode")
    assert decode and all(max(r["tile_buffers"]) == 1 and r["partial_waits"] == 0 for r in decode), decode
    assert all(r["partial_waits"] == 0 for r in attention_reports(reports, "attention"))
    assert all(r["spill_bytes"] == 0 for r in reports)
    assert problems(reports, "legacy") == []
    flagged = problems(reports, "pipelined")
    assert any("not multi-buffered" in p for p in flagged) and any("waits for all" in p for p in flagged)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (the CUDA C++ is compiled on GPU hosts)")
@pytest.mark.parametrize("source", ["kv_store.cu"])
def test_cuda_sources_compile_for_sm90(source, tmp_path):
    result = subprocess.run(
        ["nvcc", "-std=c++17", "-O3", "--use_fast_math", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v",
         "-c", str(ROOT / "csrc" / "cuda" / source), "-o", str(tmp_path / "out.o")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", result.stderr)]
    assert spills and max(spills) == 0, result.stderr[-3000:]
