"""Writes the shipped roofline profiles: `python -m scheduler.build_profiles` (deterministic; a test checks the
files in scheduler/profiles/ match what this writes)."""
from __future__ import annotations

from pathlib import Path

from scheduler.profile_table import ProfileTable
from scheduler.roofline import H100_SXM, H200_SXM, LLAMA_3_1_8B, GpuSpec, ModelShape, RooflineLatencyModel

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PREFILL_GRID = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_GRID = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
KV_GRID = (0, 4096, 16384, 65536, 262144, 1048576, 4194304)
SHIPPED = {"llama-3.1-8b_h100.json": (H100_SXM, LLAMA_3_1_8B), "llama-3.1-8b_h200.json": (H200_SXM, LLAMA_3_1_8B)}


def roofline_profile(gpu: GpuSpec, model: ModelShape) -> ProfileTable:
    roofline = RooflineLatencyModel(gpu, model)
    times = [[[roofline.predict(p, d, k) for k in KV_GRID] for d in DECODE_GRID] for p in PREFILL_GRID]
    source = (f"roofline (scheduler/roofline.py): compute at {gpu.compute_efficiency:g} x {gpu.matmul_flops:.4g} "
              f"FLOP/s plus memory at {gpu.bandwidth_efficiency:g} x {gpu.memory_bandwidth:.4g} B/s")
    return ProfileTable(PREFILL_GRID, DECODE_GRID, KV_GRID, times, model=model.name, device=gpu.name, source=source)


def main() -> None:
    PROFILE_DIR.mkdir(exist_ok=True)
    for file_name, (gpu, model) in SHIPPED.items():
        roofline_profile(gpu, model).save(PROFILE_DIR / file_name)
        print(PROFILE_DIR / file_name)


if __name__ == "__main__":
    main()
