"""Builds the native parts: the host-side hot path (always) and the CUDA kernels (only where CUDA is present)."""
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


host = Pybind11Extension(
    "engine._C",
    sources=["csrc/block_manager.cpp", "csrc/bindings.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)
cuda_exts, cmdclass = cuda_extensions()
setup(ext_modules=[host, *cuda_exts], cmdclass=cmdclass)
