"""What the vLLM engine tests share: the interpreter that runs vLLM, the tiny model it
writes, and the CPU server settings (fixtures in ``tests/engines/conftest.py``)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from dynarl.backends.serving import EngineRequest
from dynarl.backends.vllm import VLLMServerConfig

ENGINE_PYTHON = os.environ.get("DYNARL_VLLM_PYTHON", sys.executable)
"""The interpreter of the environment that has vLLM (``DYNARL_VLLM_PYTHON``, else this one)."""
TINY_LLAMA = Path(__file__).resolve().parents[1] / "dynarl" / "testing" / "_tiny_llama.py"
MAX_NUM_SEQS = 2
"""Requests the server runs at once; more wait (the priority test queues them)."""
WAIT_S = 240.0
"""Bound on waiting for the server to reach a state (a loaded machine is slow, not stuck)."""


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    """Token ids of the tiny vocabulary without its two special tokens, seeded."""
    rng = random.Random(seed)
    return [rng.randrange(0, 380) for _ in range(num_tokens)]


_WRITE_MODEL = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tiny_llama", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.write_tiny_llama(sys.argv[2], seed=0)
"""


def write_tiny_llama(python: str, directory: Path) -> Path:
    """Write the tiny random Llama (seed 0) to ``directory`` with ``python``, which has
    ``transformers`` and ``tokenizers`` (vLLM brings both; the project's venv has neither).
    The module is loaded by its file path: it imports nothing of dynarl."""
    subprocess.run(
        [python, "-c", _WRITE_MODEL, str(TINY_LLAMA), str(directory)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return directory


def server_config(python: str, model: Path, log_dir: Path) -> VLLMServerConfig:
    """The CPU settings the engine tests run with (fp32, eager, 1 GiB of KV, one thread,
    no hub)."""
    return VLLMServerConfig(
        model=str(model),
        python=python,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=MAX_NUM_SEQS,
        cpu_kvcache_space_gib=1,
        cpu_omp_threads_bind="nobind",
        omp_num_threads=1,
        env=(("HF_HUB_OFFLINE", "1"),),
        log_dir=str(log_dir),
        startup_timeout_s=600,
    )


def greedy_request(request_id: str, num_tokens: int, seed: int, priority: int = 0) -> EngineRequest:
    """A greedy, fixed-length request on a 12-token seeded prompt."""
    return EngineRequest(
        request_id=request_id,
        token_ids=tuple(prompt(12, seed)),
        max_new_tokens=num_tokens,
        temperature=0.0,
        ignore_eos=True,
        priority=priority,
    )
