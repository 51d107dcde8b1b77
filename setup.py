"""Builds the native parts: the host-side hot path (always), the CPU attention kernel (wherever torch imports) and
the CUDA kernels (only where CUDA is present)."""
import os

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup


def torch_extensions():
    """The CPU attention kernel wherever torch imports, the CUDA kernels too where CUDA is present; each can be
    skipped (POLYSERVE_SKIP_CPU_KERNELS=1, POLYSERVE_SKIP_CUDA=1)."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return [], {}
    exts = []
    if os.environ.get("POLYSERVE_SKIP_CPU_KERNELS") != "1":
        exts.append(CppExtension(
            "kernels._cpu",
            sources=["csrc/cpu/paged_decode.cpp"],
            # -march=native: the project is always built from source on the machine that runs it (./run installs
            # it there), so the kernel's loops may use every vector unit of this CPU. No -ffast-math: the loops
            # are written to vectorise without it. -fopenmp: at::parallel_for is an inline OpenMP loop, serial
            # without it; the runtime it links is the libgomp.so.1 torch has already loaded.
            extra_compile_args=["-O3", "-march=native", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ))
    if os.environ.get("POLYSERVE_SKIP_CUDA") != "1" and torch.cuda.is_available() and CUDA_HOME:
        exts.append(CUDAExtension(
            "kernels._cuda",
            sources=["csrc/cuda/bindings.cpp", "csrc/cuda/kv_store.cu", "csrc/cuda/decode_attention.cu"],
            extra_compile_args={"cxx": ["-O3"],
                                "nvcc": ["-O3", "--use_fast_math", "-gencode=arch=compute_90,code=sm_90"]},
        ))
    return exts, {"build_ext": BuildExtension} if exts else {}


host = Pybind11Extension(
    "engine._C",
    sources=["csrc/block_manager.cpp", "csrc/bindings.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)
torch_exts, cmdclass = torch_extensions()
setup(ext_modules=[host, *torch_exts], cmdclass=cmdclass)
