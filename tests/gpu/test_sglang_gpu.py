"""GPU checks of the SGLang weight-sync path (marker ``gpu``; skipped without CUDA).

``cuda_tensor_hash`` re-implements SGLang's Triton ``gpu_tensor_hash`` on the CPU so the
trainer can predict ``/weights_checker``; here it meets the real kernel, loaded from the
pinned wheel's source (``DYNARL_SGLANG_WHEEL_DIR``) and run with Triton.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import zipfile
from types import ModuleType

import pytest
import torch

from dynarl.backends.sglang._weight_check import cuda_tensor_hash

pytestmark = pytest.mark.gpu

KERNEL = "sglang/kernels/ops/memory/gpu_tensor_hash.py"


def _kernel_module(tmp_path: pathlib.Path) -> ModuleType:
    pytest.importorskip("triton")
    cache = pathlib.Path(
        os.environ.get("DYNARL_SGLANG_WHEEL_DIR", pathlib.Path.home() / ".cache/dynarl/sglang")
    )
    wheels = sorted(cache.glob("sglang-0.5.23-*.whl"))
    if not wheels:
        pytest.skip(f"no sglang 0.5.23 wheel in {cache} (run the slow schema test first)")
    source = tmp_path / "gpu_tensor_hash.py"
    with zipfile.ZipFile(wheels[0]) as archive:
        source.write_bytes(archive.read(KERNEL))
    spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("numel", [1, 7, 8192 * 4 + 3, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_cpu_reimplementation_matches_sglangs_triton_kernel(
    tmp_path: pathlib.Path, numel: int, dtype: torch.dtype
) -> None:
    kernel = _kernel_module(tmp_path)
    tensor = torch.randn(numel).to(dtype)
    assert cuda_tensor_hash(tensor) == kernel.gpu_tensor_hash(tensor.cuda())
