"""What the SGLang engine tests share: where the SGLang environment is, why a real server
cannot run here (if it cannot), its CPU launch settings, and the fake launched the same way.

The environment is ``tools/sglang_env.sh``'s (``make sglang-env``): a venv of its own,
``DYNARL_SGLANG_VENV`` or ``.venv-sglang``. Its kernel wheel is found at
``DYNARL_SGLANG_KERNEL_WHEEL`` or in ``../shared/wheels/``; that build needs AVX-512.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from dynarl.backends.sglang import SGLangServerConfig

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = Path(os.environ.get("DYNARL_SGLANG_VENV", ROOT / ".venv-sglang"))
"""The SGLang environment (``tools/sglang_env.sh VENV``)."""
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
MAX_RUNNING = 2
"""Requests a server runs at once; more wait (the priority and load tests queue them)."""
MAX_TOTAL_TOKENS = 4096
CONTEXT_LENGTH = 2048
"""The tiny model's ``max_position_embeddings``: SGLang's context length."""
"""KV pool in tokens, on both (the fake's default), so that ``token_usage`` is comparable."""
WAIT_S = 240.0
"""Bound on waiting for a server to reach a state (a loaded machine is slow, not stuck)."""
FAKE_STEP_S = 0.005
"""The fake's simulated iteration: 600 tokens take 3 s, about what the real server needs,
so that a request is still running while a test acts on it."""

SIGILL_NOTE = (
    "the sgl-kernel CPU wheel is built for AVX-512: `import sgl_kernel`, which "
    "sglang.launch_server runs while resolving its arguments, dies with SIGILL (exit code "
    "-4, no traceback) loading common_ops.so, whose op registration runs AVX-512 instructions"
)
"""What happens on a CPU without ``avx512f`` (measured)."""


def kernel_wheel() -> Path | None:
    """The sgl-kernel CPU wheel: ``DYNARL_SGLANG_KERNEL_WHEEL``, else the newest
    ``sglang_kernel_cpu-*.whl`` in ``../shared/wheels/``; None if there is none."""
    named = os.environ.get("DYNARL_SGLANG_KERNEL_WHEEL")
    if named:
        return Path(named) if Path(named).is_file() else None
    found = sorted((ROOT.parent / "shared" / "wheels").glob("sglang_kernel_cpu-*.whl"))
    return found[-1] if found else None


def cpu_has_avx512f(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU flags list ``avx512f``."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512f" in line.split() for line in text.splitlines())


def missing_sglang() -> str | None:
    """Why a real SGLang server cannot run here, or None if it can. Checked in the order
    the environment's set-up checks: the wheel, the CPU (``DYNARL_SGLANG_ENV_FORCE=1``
    skips this one, as it does there: for a kernel rebuilt without AVX-512), the built
    environment."""
    if kernel_wheel() is None:
        return (
            "no sgl-kernel CPU wheel (set DYNARL_SGLANG_KERNEL_WHEEL or put "
            "sglang_kernel_cpu-*.whl in ../shared/wheels/)"
        )
    if not cpu_has_avx512f() and os.environ.get("DYNARL_SGLANG_ENV_FORCE") != "1":
        return f"this CPU lacks avx512f: {SIGILL_NOTE}"
    if not (SGLANG_VENV / ".sglang-env-stamp").is_file() or not SGLANG_PYTHON.exists():
        return f"the SGLang environment {SGLANG_VENV} is not built (run `make sglang-env`)"
    return None


def server_config(model: Path, log_path: Path) -> SGLangServerConfig:
    """The CPU launch the engine tests use (the measured recipe): torch-native attention
    and sampling, a 4096-token KV pool, priority scheduling, no warm-up, no hub."""
    return SGLangServerConfig(
        model_path=str(model),
        python=str(SGLANG_PYTHON),
        enable_memory_saver=False,
        enable_priority_scheduling=True,
        extra_args=(
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--mem-fraction-static",
            "0.05",
            "--max-running-requests",
            str(MAX_RUNNING),
            "--max-total-tokens",
            str(MAX_TOTAL_TOKENS),
            "--skip-server-warmup",
            "--enable-metrics",
        ),
        env=(
            ("SGLANG_USE_CPU_ENGINE", "1"),
            ("HF_HUB_OFFLINE", "1"),
            # one OpenMP thread on one core: SGLang's default, a thread on every core, made
            # a decode step 30-40x slower whenever another process was busy on this host
            ("OMP_NUM_THREADS", "1"),
            ("SGLANG_CPU_OMP_THREADS_BIND", "0"),
        ),
        log_path=str(log_path),
        startup_timeout_s=600.0,
    )


def fake_server_config(weights: Path, log_path: Path) -> SGLangServerConfig:
    """The fake (``python -m dynarl.testing.sglang_fake``, a process of its own, as the real
    server is) launched with :func:`server_config`'s flags; it ignores those it does not
    model. ``weights`` is a ``torch.save``'d dict of HF-named tensors."""
    real = server_config(weights.parent, log_path)
    return replace(
        real,
        python=sys.executable,
        module="dynarl.testing.sglang_fake",
        extra_args=(
            *real.extra_args,
            "--fake-step-interval",
            str(FAKE_STEP_S),
            "--fake-weights",
            str(weights),
        ),
        env=(),
        startup_timeout_s=120.0,
    )
