"""The install cannot be broken by the GPU toolchain: setup.py skips the CUDA kernels, with a warning, where torch
and nvcc disagree or their build fails, and builds everything else; without them the CUDA device keeps the Triton
kernels. The Triton kernels refuse, by name, a Triton too old for them."""
from __future__ import annotations

import importlib.util
import re
import runpy
import stat
import sys
from pathlib import Path

import pytest
import torch
from setuptools import Distribution, Extension
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parents[1]
SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="polyserve_setup")


@pytest.mark.parametrize("torch_cuda, nvcc, problem", [
    ("12.8", "12.8", None),
    ("12.4", "12.8", None),  # a minor mismatch builds
    ("13.0", "13.2", None),
    ("12.8", "13.0", "torch was built with CUDA 12.8 and nvcc is CUDA 13.0; the major releases must match"),
    ("13.0", "12.9", "torch was built with CUDA 13.0 and nvcc is CUDA 12.9"),
    (None, "13.0", "this torch has no CUDA"),
    ("12.8", None, "no nvcc was found"),
])
def test_cuda_toolchain_problem(torch_cuda, nvcc, problem):
    found = SETUP["cuda_toolchain_problem"](torch_cuda, nvcc)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_nvcc_release_reads_the_banner(tmp_path):
    nvcc_release = SETUP["nvcc_release"]
    assert nvcc_release(None) is None
    assert nvcc_release(str(tmp_path / "no-toolkit")) is None
    (tmp_path / "bin").mkdir()
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    "echo 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    assert nvcc_release(str(tmp_path)) == "12.8"
    nvcc.write_text("#!/bin/sh\necho 'something else'\n")
    assert nvcc_release(str(tmp_path)) is None


class ToolchainCheckFails(build_ext):
    """Stands for torch's BuildExtension where its CUDA checks fail: they raise before any extension compiles."""

    def build_extensions(self):
        if any(ext.name == SETUP["CUDA_EXTENSION"] for ext in self.extensions):
            raise RuntimeError("The detected CUDA version (13.0) mismatches the version that was used to compile "
                               "PyTorch (12.8).")
        super().build_extensions()


def build(tmp_path: Path, monkeypatch, base: type, sources: dict[str, str]) -> tuple[list[str], Exception | None]:
    """Builds one extension per source (name -> C code) in place under tmp_path with optional_cuda(base); returns
    the extension modules built and what the build raised."""
    monkeypatch.chdir(tmp_path)
    extensions = []
    for name, code in sources.items():
        Path(name.split(".")[0]).mkdir(exist_ok=True)
        source = Path(f"{name.replace('.', '_')}.c")
        source.write_text(code)
        extensions.append(Extension(name, sources=[str(source)]))
    dist = Distribution(dict(name="probe", ext_modules=extensions,
                             cmdclass={"build_ext": SETUP["optional_cuda"](base)}))
    command = dist.get_command_obj("build_ext")
    command.inplace, command.build_temp = True, "build"
    try:
        dist.run_command("build_ext")
        raised = None
    except Exception as error:
        raised = error
    built = sorted(f"{package}.{library.name.split('.')[0]}" for package in ("engine", "kernels")
                   for library in Path(package).glob("*.so"))
    return built, raised


MODULE = "#include <Python.h>\nstatic struct PyModuleDef m = {{PyModuleDef_HEAD_INIT, \"{name}\", 0, -1, 0}};\n" \
         "PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&m); }}\n"
BROKEN = "this is not C;\n"


def test_a_cuda_extension_that_fails_to_compile_is_skipped_with_a_warning(tmp_path, monkeypatch, capfd):
    built, raised = build(tmp_path, monkeypatch, build_ext, {"engine._C": MODULE.format(name="_C"),
                                                             SETUP["CUDA_EXTENSION"]: BROKEN})
    assert raised is None
    assert built == ["engine._C"]
    assert "WARNING: kernels._cuda (the CUDA C++ kernels) is not built: its build failed" in capfd.readouterr().err


def test_a_failing_toolchain_check_skips_only_the_cuda_extension(tmp_path, monkeypatch, capfd):
    built, raised = build(tmp_path, monkeypatch, ToolchainCheckFails,
                          {"engine._C": MODULE.format(name="_C"), SETUP["CUDA_EXTENSION"]: MODULE.format(name="_cuda")})
    assert raised is None
    assert built == ["engine._C"]
    err = capfd.readouterr().err
    assert "is not built: the toolchain check failed: " in err and "mismatches the version" in err


def test_any_other_extension_that_fails_still_fails_the_build(tmp_path, monkeypatch):
    built, raised = build(tmp_path, monkeypatch, build_ext,
                          {"engine._C": BROKEN, SETUP["CUDA_EXTENSION"]: MODULE.format(name="_cuda")})
    assert isinstance(raised, CompileError)
    assert "engine._C" not in built


@pytest.mark.skipif(importlib.util.find_spec("kernels._cuda") is not None, reason="kernels._cuda is built here")
def test_without_the_cuda_extension_cuda_devices_keep_the_triton_kernels(monkeypatch):
    from kernels import get_ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the choice only; nothing runs on a device
    assert get_ops("cuda").name.startswith("triton")
    assert "kernels._cuda" not in sys.modules
    with pytest.raises(ImportError, match="kernels._cuda is not built"):
        get_ops("cuda", backend="cuda")


@pytest.mark.parametrize("version, refused", [("3.3.1", True), ("2.3.0", True), ("3.4.0", False),
                                              ("3.6.0", False), ("3.10.0+git1a2b3c", False), ("4.0.0", False)])
def test_the_triton_kernels_name_a_triton_too_old_for_them(monkeypatch, version, refused):
    import triton

    from kernels import get_ops
    from kernels.dispatch import require_triton

    monkeypatch.setattr(triton, "__version__", version)
    if refused:
        with pytest.raises(ImportError, match=rf"need triton >= 3\.4; triton {re.escape(version)} is installed"):
            get_ops("cpu", backend="triton")
    else:
        require_triton()
