"""Start and stop a vLLM 0.32 server (``python -m vllm.entrypoints.openai.api_server``).

:func:`launch_command` and :func:`server_env` build the command line and environment (pure).
The server always runs in dev mode (``VLLM_SERVER_DEV_MODE=1``: pause, resume, abort,
weight versions, ``/collective_rpc``) with the token-id endpoint (``--enable-scale-out``),
cached-token counts per request (``--enable-prompt-tokens-details``) and priority
scheduling. Dev mode lets anyone who reaches the port run methods on the engine's workers
(``/collective_rpc``), so the server binds to loopback unless told otherwise.

:class:`VLLMServer` starts it as a :class:`~dynarl.backends._server_process.ServerProcess`
(its own process group with the engine core and workers, a parent-death signal), waits for
``/health`` to answer 200 before a deadline, and stops the group on ``aclose()``. A server
that exits or misses the deadline raises :class:`~dynarl.errors.BackendError` with its log
tail, and is stopped first. Runs on the caller's event loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from dynarl.backends._server_process import ManagedServer
from dynarl.backends.vllm._client import VLLMClient, VLLMClientConfig

__all__ = [
    "WEIGHT_RECEIVER",
    "VLLMServer",
    "VLLMServerConfig",
    "engine_flags",
    "launch_command",
    "missing_vllm",
    "server_env",
]

WEIGHT_RECEIVER = "dynarl.backends.vllm.worker_extension.WeightReceiver"
"""The worker extension that receives weight pushes (the server's interpreter must be able
to import dynarl; None in :attr:`VLLMServerConfig.worker_extension_cls` leaves it out)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VLLMServerConfig:
    """A vLLM server to launch (the flags dynarl relies on, plus ``extra_args``)."""

    model: str
    """``--model``: a model directory (or hub name, where the hub is reachable)."""
    host: str = "127.0.0.1"
    """``--host``; loopback unless the worker that drives it is on another host."""
    port: int = 0
    """``--port``; 0 picks a free one."""
    dtype: str = "auto"
    """``--dtype``."""
    max_model_len: int | None = None
    """``--max-model-len``; None: the model's."""
    max_num_seqs: int | None = None
    """``--max-num-seqs``: requests in the running batch; the rest wait. None: vLLM's."""
    num_gpu_blocks_override: int | None = None
    """``--num-gpu-blocks-override``: the KV-cache size in blocks (on CPU too), so that KV
    use tracks the job's load. None: sized from memory."""
    enable_prefix_caching: bool = True
    """``--enable-prefix-caching`` (else ``--no-enable-prefix-caching``)."""
    enforce_eager: bool = False
    """``--enforce-eager`` (no graph capture)."""
    worker_extension_cls: str | None = WEIGHT_RECEIVER
    """``--worker-extension-cls``: a class whose methods ``/collective_rpc`` can call."""
    cpu_kvcache_space_gib: int | None = None
    """``VLLM_CPU_KVCACHE_SPACE`` (CPU build): GiB of KV cache, a whole number."""
    cpu_omp_threads_bind: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` (CPU build): ``"nobind"``, ``"auto"`` or core ids."""
    omp_num_threads: int | None = None
    """``OMP_NUM_THREADS`` of the server's processes."""
    cpus: tuple[int, ...] = ()
    """Cores the server's processes run on (their affinity; the engine's OpenMP threads
    bound there, one per core, unless ``cpu_omp_threads_bind`` / ``omp_num_threads`` say
    otherwise). Empty: the caller's cores."""
    extra_args: tuple[str, ...] = ()
    """Further flags, passed as they are."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment entries added last."""
    python: str = sys.executable
    """Interpreter of the environment that has vLLM."""
    module: str = "vllm.entrypoints.openai.api_server"
    """Module run with ``-m`` (the ``vllm`` console script fails for the ``vllm-cpu``
    distribution)."""
    log_dir: str | None = None
    """Directory for the server's log, ``vllm-<port>.log`` (kept); None: a temporary file,
    removed on close."""
    startup_timeout_s: float = 900.0
    """Deadline for ``/health`` to answer 200 (loading and compiling take minutes)."""
    health_poll_s: float = 0.5
    """Pause between health probes."""
    stop_timeout_s: float = 30.0
    """Grace period between SIGTERM and SIGKILL."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("VLLMServerConfig.model must be a non-empty string")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in (
            "max_model_len",
            "max_num_seqs",
            "num_gpu_blocks_override",
            "cpu_kvcache_space_gib",
            "omp_num_threads",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        for name in ("startup_timeout_s", "health_poll_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def launch_command(config: VLLMServerConfig, port: int) -> list[str]:
    """The argv that starts ``config``'s server on ``port``: the server's own flags (address,
    the token-id route, cached-token counts), then :func:`engine_flags`, then
    ``extra_args``."""
    server = ["--host", config.host, "--port", str(port)]
    server += ["--enable-scale-out", "--enable-prompt-tokens-details"]
    return [config.python, "-m", config.module, *server, *engine_flags(config), *config.extra_args]


def engine_flags(config: VLLMServerConfig) -> list[str]:
    """The engine's flags for ``config`` (model, dtype, priority scheduling, prefix caching,
    limits, the worker extension, eager mode): what a server and an in-process engine
    (``VLLMInProcessEngine``) both take; not ``extra_args``."""
    argv = ["--model", config.model, "--dtype", config.dtype, "--scheduling-policy", "priority"]
    argv.append(
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    for flag, value in (
        ("--max-model-len", config.max_model_len),
        ("--max-num-seqs", config.max_num_seqs),
        ("--num-gpu-blocks-override", config.num_gpu_blocks_override),
        ("--worker-extension-cls", config.worker_extension_cls),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def server_env(config: VLLMServerConfig) -> dict[str, str]:
    """The environment entries the server gets on top of the caller's."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}
    cpus = config.cpus
    for key, value in (
        ("VLLM_CPU_KVCACHE_SPACE", config.cpu_kvcache_space_gib),
        (
            "VLLM_CPU_OMP_THREADS_BIND",
            config.cpu_omp_threads_bind or (",".join(map(str, cpus)) if cpus else None),
        ),
        ("OMP_NUM_THREADS", config.omp_num_threads or (len(cpus) if cpus else None)),
    ):
        if value is not None:
            env[key] = str(value)
    return env | dict(config.env)


class VLLMServer(ManagedServer):
    """A vLLM server this object started and will stop; ``async with VLLMServer(cfg)``."""

    engine = "vLLM"

    def __init__(self, config: VLLMServerConfig) -> None:
        super().__init__(config)
        self.config = config

    def client_config(self) -> VLLMClientConfig:
        """A :class:`VLLMClientConfig` for this server (change its deadlines with
        :func:`dataclasses.replace`)."""
        return VLLMClientConfig(base_url=self.url)

    def _command(self, port: int) -> list[str]:
        return launch_command(self.config, port)

    def _env(self) -> dict[str, str]:
        return server_env(self.config)

    def _log_file(self, port: int) -> str | None:
        if self.config.log_dir is None:
            return None
        os.makedirs(self.config.log_dir, exist_ok=True)
        return os.path.join(self.config.log_dir, f"vllm-{port}.log")

    def _probe(self) -> VLLMClient:
        return VLLMClient(
            VLLMClientConfig(
                base_url=self.url, num_attempts=1, timeout_s=5.0, connect_timeout_s=1.0
            )
        )


def missing_vllm(python: str) -> str | None:
    """Why the interpreter ``python`` cannot run a vLLM server (it does not exist, or vLLM is
    not importable there), or None if it can. Looked up, not imported (an import takes
    seconds): a subprocess, bounded at 2 minutes."""
    if not os.path.exists(python):
        return f"DYNARL_VLLM_PYTHON={python} does not exist"
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"
    done = subprocess.run([python, "-c", probe], capture_output=True, timeout=120, check=False)
    if done.returncode != 0:
        return f"vllm is not importable by {python} (set DYNARL_VLLM_PYTHON to an env with it)"
    return None
