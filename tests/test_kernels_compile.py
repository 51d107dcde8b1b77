"""What can be checked of the GPU code without a GPU: the Triton kernels compile for Hopper (sm_90) into code
without register spills, the prefill products become wgmma and the attention loads are pipelined; the CUDA C++
sources compile with nvcc for sm_90. Both run in subprocesses (the Triton check swaps Triton's driver)."""
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


@pytest.mark.skipif(not _nvidia_backend_present(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_triton_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    kernels = {r["kernel"] for r in reports}
    assert {"_paged_attention_kernel", "_merge_splits_kernel", "_store_kvcache_kernel", "_rms_norm_kernel",
            "_rotary_kernel", "_silu_and_mul_kernel"} <= kernels
    for r in reports:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 227 * 1024, r  # Hopper's per-block shared-memory limit
    for r in reports:
        if r["kernel"] == "_paged_attention_kernel":
            assert r["pipelined"], r
            assert r["wgmma"] == r["launch"].startswith("attention prefill"), r


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (the CUDA C++ is compiled on GPU hosts)")
@pytest.mark.parametrize("source", ["kv_store.cu", "decode_attention.cu"])
def test_cuda_sources_compile_for_sm90(source, tmp_path):
    result = subprocess.run(
        ["nvcc", "-std=c++17", "-O3", "--use_fast_math", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v",
         "-c", str(ROOT / "csrc" / "cuda" / source), "-o", str(tmp_path / "out.o")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", result.stderr)]
    assert spills and max(spills) == 0, result.stderr[-3000:]
