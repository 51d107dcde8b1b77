"""Builds the native parts: the host-side hot path (always), the CPU attention kernel (wherever torch imports) and
the CUDA kernels (only where CUDA is present)."""
import os

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup


def cuda_extensions():
    if os.environ.get("POLYSERVE_SKIP_CUDA") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if not (torch.cuda.is_available() and CUDA_HOME):
        return [], {}
    ext = CUDAExtension(
        "kernels._cuda",
        sources=["csrc/cuda/bindings.cpp", "csrc/cuda/kv_store.cu", "csrc/cuda/decode_attention.cu"],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-gencode=arch=compute_90,code=sm_90"]},
    )
    return [ext], {"build_ext": BuildExtension}


def cpu_extensions():
    if os.environ.get("POLYSERVE_SKIP_CPU_KERNELS") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    ext = CppExtension(
        "kernels._cpu",
        sources=["csrc/cpu/paged_decode.cpp"],
        # -march=native: the project is always built from source on the machine that runs it (./run installs it
        # there), so the kernel's loops may use every vector unit of this CPU. No -ffast-math: the loops are
        # written to vectorise without it. -fopenmp: at::parallel_for is an inline OpenMP loop, serial without
        # it; the runtime it links is the libgomp.so.1 torch has already loaded.
        extra_compile_args=["-O3", "-march=native", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension}


host = Pybind11Extension(
    "engine._C",
    sources=["csrc/block_manager.cpp", "csrc/bindings.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)
cpu_exts, cpu_cmdclass = cpu_extensions()
cuda_exts, cuda_cmdclass = cuda_extensions()
setup(ext_modules=[host, *cpu_exts, *cuda_exts], cmdclass={**cpu_cmdclass, **cuda_cmdclass})
