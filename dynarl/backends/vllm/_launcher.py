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
import sys
from dataclasses import dataclass

from dynarl.backends._server_process import ServerProcess, free_port
from dynarl.backends.vllm._client import VLLMClient, VLLMClientConfig

__all__ = ["VLLMServer", "VLLMServerConfig", "launch_command", "server_env"]


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
    worker_extension_cls: str | None = None
    """``--worker-extension-cls``: a class whose methods ``/collective_rpc`` can call."""
    cpu_kvcache_space_gib: int | None = None
    """``VLLM_CPU_KVCACHE_SPACE`` (CPU build): GiB of KV cache, a whole number."""
    cpu_omp_threads_bind: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` (CPU build): ``"nobind"``, ``"auto"`` or core ids."""
    omp_num_threads: int | None = None
    """``OMP_NUM_THREADS`` of the server's processes."""
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
    """The argv that starts ``config``'s server on ``port``."""
    argv = [
        config.python,
        "-m",
        config.module,
        "--model",
        config.model,
        "--host",
        config.host,
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        "--scheduling-policy",
        "priority",
        "--enable-scale-out",
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
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
    return argv + list(config.extra_args)


def server_env(config: VLLMServerConfig) -> dict[str, str]:
    """The environment entries the server gets on top of the caller's."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}
    for key, value in (
        ("VLLM_CPU_KVCACHE_SPACE", config.cpu_kvcache_space_gib),
        ("VLLM_CPU_OMP_THREADS_BIND", config.cpu_omp_threads_bind),
        ("OMP_NUM_THREADS", config.omp_num_threads),
    ):
        if value is not None:
            env[key] = str(value)
    return env | dict(config.env)


class VLLMServer:
    """A vLLM server this object started and will stop; ``async with VLLMServer(cfg)``."""

    def __init__(self, config: VLLMServerConfig) -> None:
        self.config = config
        self.port = config.port
        self._process: ServerProcess | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id (and process-group id) of the server, while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> str | None:
        """The server's log file, while it runs (and after, under ``log_dir``)."""
        return self._process.log_path if self._process is not None else None

    def client_config(self) -> VLLMClientConfig:
        """A :class:`VLLMClientConfig` for this server (change its deadlines with
        :func:`dataclasses.replace`)."""
        return VLLMClientConfig(base_url=self.url)

    async def __aenter__(self) -> VLLMServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the server and wait until ``/health`` answers 200.

        Raises BackendError naming vLLM, with the log tail, if it exits or misses the
        deadline (it is stopped first); RuntimeError if already started.
        """
        if self._process is not None:
            raise RuntimeError("vLLM server already started")
        self.port = self.config.port or free_port(self.config.host)
        log_path = None
        if self.config.log_dir is not None:
            os.makedirs(self.config.log_dir, exist_ok=True)
            log_path = os.path.join(self.config.log_dir, f"vllm-{self.port}.log")
        self._process = ServerProcess(
            "vLLM", log_path=log_path, stop_timeout_s=self.config.stop_timeout_s
        )
        try:
            await self._process.start(
                launch_command(self.config, self.port), server_env(self.config)
            )
            probe = VLLMClient(
                VLLMClientConfig(
                    base_url=self.url, num_attempts=1, timeout_s=5.0, connect_timeout_s=1.0
                )
            )
            async with probe:
                await self._process.wait_healthy(
                    probe.health,
                    timeout_s=self.config.startup_timeout_s,
                    poll_s=self.config.health_poll_s,
                )
        except BaseException:
            await self.aclose()
            raise

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The end of the server's log."""
        return self._process.log_tail(num_bytes) if self._process is not None else ""

    async def aclose(self) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL; idempotent."""
        process, self._process = self._process, None
        if process is not None:
            await process.aclose()
