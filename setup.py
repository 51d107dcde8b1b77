"""Builds the native parts: the host-side hot path (always), the CPU attention kernel (wherever torch imports) and
the CUDA kernels (where CUDA is present). The CUDA kernels are optional: a toolchain that cannot build them (torch
without CUDA, no nvcc, nvcc of another CUDA major than torch's, a compiler torch refuses, an nvcc error) leaves a
warning and the Triton kernels, never a failed install."""
import os
import re
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

CUDA_EXTENSION = "kernels._cuda"


def nvcc_release(cuda_home: str | None) -> str | None:
    """The CUDA release of `cuda_home`'s nvcc ("13.0"), or None where there is no nvcc that answers."""
    if not cuda_home:
        return None
    try:
        banner = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                                text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", banner)
    return match.group(1) if match else None


def cuda_toolchain_problem(torch_cuda: str | None, nvcc: str | None) -> str | None:
    """Why the CUDA kernels cannot be built against a torch built with CUDA `torch_cuda` ("12.8", None for a CPU or
    ROCm build) by an nvcc of release `nvcc`, or None when they can: torch refuses to build an extension whose
    nvcc has another major release than its own (a different minor release works)."""
    if torch_cuda is None:
        return "this torch has no CUDA (a CPU or ROCm build)"
    if nvcc is None:
        return "no nvcc was found (set CUDA_HOME to the CUDA toolkit of torch's CUDA major release)"
    if torch_cuda.split(".")[0] != nvcc.split(".")[0]:
        return (f"torch was built with CUDA {torch_cuda} and nvcc is CUDA {nvcc}; the major releases must match "
                f"(install the torch build for CUDA {nvcc.split('.')[0]}, or point CUDA_HOME at a CUDA "
                f"{torch_cuda.split('.')[0]} toolkit)")
    return None


def warn_cuda_skipped(reason: str) -> None:
    print(f"\nWARNING: {CUDA_EXTENSION} (the CUDA C++ kernels) is not built: {reason}\n"
          f"WARNING: the install goes on without it; the Triton kernels (the default on CUDA) serve every op, and "
          f"only the 'cuda' kernel backend is unavailable.\n", file=sys.stderr, flush=True)


def optional_cuda(build_ext_class: type) -> type:
    """`build_ext_class` building the CUDA extension optionally: a failure to build it, whether in the toolchain
    checks that run before any extension compiles (torch's) or in its own compile and link, is a warning; a
    failure of any other extension still fails the build."""

    class BuildExtOptionalCuda(build_ext_class):
        def build_extensions(self):
            self.compiled_any, self.cuda_failed = False, False
            try:
                super().build_extensions()
            except Exception as error:
                if self.compiled_any or not any(ext.name == CUDA_EXTENSION for ext in self.extensions):
                    raise
                warn_cuda_skipped(f"the toolchain check failed: {error}")
                self.drop_cuda()
                super().build_extensions()
            if self.cuda_failed:
                self.drop_cuda()

        def build_extension(self, ext):
            self.compiled_any = True
            if ext.name != CUDA_EXTENSION:
                return super().build_extension(ext)
            try:
                return super().build_extension(ext)
            except Exception as error:
                warn_cuda_skipped(f"its build failed: {error}")
                self.cuda_failed = True
                return None

        def drop_cuda(self):
            """Forget the extension, so that the steps after the build (the in-place copy, the wheel's file
            list) do not look for its library. In place: the distribution holds the same list."""
            self.extensions[:] = [ext for ext in self.extensions if ext.name != CUDA_EXTENSION]

    return BuildExtOptionalCuda


def torch_extensions():
    """The CPU attention kernel wherever torch imports, the CUDA kernels too where CUDA is present and the toolchain
    can build them; each can be skipped (POLYSERVE_SKIP_CPU_KERNELS=1, POLYSERVE_SKIP_CUDA=1)."""
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
    if os.environ.get("POLYSERVE_SKIP_CUDA") != "1" and torch.cuda.is_available():
        problem = cuda_toolchain_problem(torch.version.cuda, nvcc_release(CUDA_HOME))
        if problem is not None:
            warn_cuda_skipped(problem)
        else:
            exts.append(CUDAExtension(
                CUDA_EXTENSION,
                sources=["csrc/cuda/bindings.cpp", "csrc/cuda/kv_store.cu"],
                extra_compile_args={"cxx": ["-O3"],
                                    "nvcc": ["-O3", "--use_fast_math", "-gencode=arch=compute_90,code=sm_90"]},
            ))
    return exts, {"build_ext": optional_cuda(BuildExtension)} if exts else {}


if __name__ == "__main__":  # pip and `python setup.py` run it as the main module; the tests import its functions
    host = Pybind11Extension(
        "engine._C",
        sources=["csrc/block_manager.cpp", "csrc/fold_sums.cpp", "csrc/bindings.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
    torch_exts, cmdclass = torch_extensions()
    setup(ext_modules=[host, *torch_exts], cmdclass=cmdclass)
