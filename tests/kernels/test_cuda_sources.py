"""The CUDA sources of the GPU path (xla_ffi/cuda/) compile with nvcc against this jaxlib's XLA
FFI headers. Only compiled here: running them needs a GPU (benchmarks/gpu_check.py)."""

import pathlib
import shutil
import subprocess
import sysconfig

import jax.ffi
import pytest

SOURCES = pathlib.Path(__file__).resolve().parents[2] / "xla_ffi" / "cuda"
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed here")
@pytest.mark.parametrize("source", ["device_kernels.cu", "handlers.cc", "module.cc"])
def test_cuda_source_compiles(source, tmp_path):
  nanobind = pytest.importorskip("nanobind")
  includes = [jax.ffi.include_dir(), nanobind.include_dir(), sysconfig.get_paths()["include"],
              str(SOURCES.parent)]
  command = [NVCC, "-std=c++17", "-O1", "-c", str(SOURCES / source), "-o",
             str(tmp_path / (source + ".o")), "-Xcompiler", "-fPIC"]
  command += [f"-I{path}" for path in includes]
  if source.endswith(".cu"):
    command += ["-arch=sm_90"]
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
  assert (tmp_path / (source + ".o")).stat().st_size > 0
