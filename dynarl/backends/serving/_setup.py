"""``EngineSetup``: which engine a serving component runs on each of its devices, and how.

A component's options carry it as one JSON text (:meth:`EngineSetup.to_options`), read
back in every worker (:meth:`EngineSetup.from_options`); :meth:`EngineSetup.build` builds
the :class:`~dynarl.backends._engine.Engine` for one device: a server launched for that
device (``model`` set), or one already running at ``urls[device]`` (attach). Pure except
:meth:`build`, which only constructs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Literal

import msgspec

from dynarl.backends._engine import Engine
from dynarl.backends._json_option import json_option, read_json_option
from dynarl.backends.sglang import ClientConfig, SGLangServerConfig, SGLangServerEngine
from dynarl.backends.vllm import (
    VLLMClientConfig,
    VLLMEngine,
    VLLMInProcessEngine,
    VLLMServerConfig,
)
from dynarl.bus import MetaValue

__all__ = ["SETUP_OPTION", "EngineSetup"]

SETUP_OPTION = "engine_setup"
"""The component option that holds the setup's JSON text."""


class EngineSetup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a serving component's engines run (see the module docstring).

    Launch mode (``model`` set) starts one engine per device (a server, or in the worker's
    process: ``mode``); attach mode (``urls``) drives servers someone else runs, one URL
    per device id.
    """

    kind: Literal["vllm", "sglang"] = "vllm"
    """Which engine."""
    mode: Literal["server", "inprocess"] = "server"
    """Launch mode only: ``server`` runs each device's engine as a server process the role
    talks to over HTTP (the default: the engine's crashes stay out of the worker, and it
    may live in an environment of its own); ``inprocess`` (vLLM only) runs vLLM's
    ``AsyncLLM`` inside the worker process (``VLLMInProcessEngine``: one process fewer,
    ~0.45 GB less memory and a faster start, measured in ``docs/engines.md``)."""
    model: str = ""
    """Model directory to launch servers on (launch mode)."""
    urls: dict[str, str] = {}
    """Device id (as text) → root URL of a running server (attach mode)."""
    python: str = ""
    """Interpreter of the engine's environment (empty: the worker's own)."""
    module: str = ""
    """The server's module, run as ``python -m MODULE`` (empty: the engine's own,
    ``vllm.entrypoints.openai.api_server`` or ``sglang.launch_server``): a site's wrapper,
    or ``dynarl.testing.sglang_fake`` in tests. It takes the engine's flags."""
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    """Requests an engine runs at once; the rest queue at the engine."""
    kv_blocks: int | None = None
    """KV-cache size in blocks (vLLM ``--num-gpu-blocks-override``; works on CPU)."""
    cpu_kvcache_space_gib: int | None = None
    """vLLM's CPU KV space in whole GiB."""
    omp_num_threads: int | None = None
    """Threads of each engine's processes."""
    enforce_eager: bool = True
    extra_args: tuple[str, ...] = ()
    """Further server flags."""
    env: dict[str, str] = {}
    """Environment entries for the server processes."""
    log_dir: str = ""
    """Where server logs go (empty: a temporary file each, removed on close)."""
    startup_timeout_s: float = 600.0
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a generation (besides the model's end of sequence)."""
    ignore_eos: bool = False
    """Generate past end of sequence (fixed-length workloads)."""
    metrics_interval_s: float = 0.25
    """How often the role reads its engine's load."""
    generate_timeout_s: float = 3600.0
    """Deadline of one generation."""

    def __post_init__(self) -> None:
        if bool(self.model) == bool(self.urls):
            raise ValueError(
                "EngineSetup needs exactly one of model= (launch a server per device) or "
                "urls= (attach to running servers)"
            )
        if self.mode == "inprocess" and (self.kind != "vllm" or self.urls or self.python):
            raise ValueError(
                "EngineSetup.mode='inprocess' runs vLLM inside the worker: it needs "
                "kind='vllm', model= (not urls=) and no python= (the worker's own interpreter)"
            )
        for device, url in self.urls.items():
            if not device.isdigit() or not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"EngineSetup.urls: {device!r}: {url!r} is not 'device id': 'http(s)://...'"
                )
        for name in ("max_model_len", "max_num_seqs", "kv_blocks", "cpu_kvcache_space_gib"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"EngineSetup.{name} must be >= 1 or None, got {value}")
        for name in ("startup_timeout_s", "metrics_interval_s", "generate_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EngineSetup.{name} must be > 0, got {getattr(self, name)}")

    def to_options(self) -> dict[str, MetaValue]:
        """The component options that carry this setup."""
        return json_option(SETUP_OPTION, self)

    @classmethod
    def from_options(cls, options: Mapping[str, MetaValue]) -> EngineSetup:
        """The setup in a component's options; ValueError naming what is wrong."""
        return read_json_option(options, SETUP_OPTION, cls, "engine setup")

    def build(self, device: int, *, cpus: tuple[int, ...] = ()) -> Engine:
        """The engine of ``device`` (constructed, not started); ValueError in attach mode
        when no URL is given for it. ``cpus``: the cores a launched server runs on, its
        OpenMP threads one per core unless ``omp_num_threads`` says otherwise (the worker's
        pinning, ``RuntimeConfig.pin_cores``); an attached server is where it is."""
        url = None
        if self.urls:
            url = self.urls.get(str(device))
            if url is None:
                raise ValueError(
                    f"EngineSetup.urls has no server for device {device} "
                    f"(it has devices {sorted(self.urls, key=int)})"
                )
        if self.kind == "vllm":
            return self._vllm(device, url, cpus)
        return self._sglang(device, url, cpus)

    def _vllm(self, device: int, url: str | None, cpus: tuple[int, ...]) -> Engine:
        if url is not None:
            client = VLLMClientConfig(base_url=url, generate_timeout_s=self.generate_timeout_s)
            return VLLMEngine(url=url, max_num_seqs=self.max_num_seqs, client=client)
        server = VLLMServerConfig(
            model=self.model,
            python=self.python or sys.executable,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            num_gpu_blocks_override=self.kv_blocks,
            enforce_eager=self.enforce_eager,
            cpu_kvcache_space_gib=self.cpu_kvcache_space_gib,
            omp_num_threads=self.omp_num_threads,
            cpus=cpus,
            extra_args=self.extra_args,
            env=tuple(self.env.items()),
            log_dir=os.path.join(self.log_dir, f"device-{device}") if self.log_dir else None,
            startup_timeout_s=self.startup_timeout_s,
        )
        if self.module:
            server = replace(server, module=self.module)
        if self.mode == "inprocess":
            return VLLMInProcessEngine(server, device=device)
        return VLLMEngine(server=server)

    def _sglang(self, device: int, url: str | None, cpus: tuple[int, ...]) -> Engine:
        if url is not None:
            client = ClientConfig(base_url=url, generate_timeout_s=self.generate_timeout_s)
            return SGLangServerEngine(url=url, client=client)
        args = ["--dtype", self.dtype]
        for flag, value in (
            ("--context-length", self.max_model_len),
            ("--max-running-requests", self.max_num_seqs),
            # SGLang's KV block is its page: --page-size tokens, 1 unless extra_args set it.
            ("--max-total-tokens", self.kv_blocks and self.kv_blocks * _page_size(self)),
        ):
            if value is not None:
                args += [flag, str(value)]
        env = dict(self.env)
        threads = self.omp_num_threads or (len(cpus) if cpus else None)
        if threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        if cpus:  # SGLang's CPU engine binds its OpenMP threads to this list
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
        log = os.path.join(self.log_dir, f"device-{device}", "sglang.log") if self.log_dir else None
        server = SGLangServerConfig(
            model_path=self.model,
            python=self.python or sys.executable,
            # The role pauses in place and never releases memory; the saver needs CUDA.
            enable_memory_saver=False,
            enable_priority_scheduling=True,
            extra_args=(*args, *self.extra_args),
            env=tuple(env.items()),
            cpus=cpus,
            log_path=log,
            startup_timeout_s=self.startup_timeout_s,
        )
        if self.module:
            server = replace(server, module=self.module)
        return SGLangServerEngine(server=server)


def _page_size(setup: EngineSetup) -> int:
    """``--page-size`` as ``extra_args`` give it (SGLang's default: 1)."""
    args = setup.extra_args
    for index, arg in enumerate(args):
        if arg == "--page-size" and index + 1 < len(args):
            return int(args[index + 1])
        if arg.startswith("--page-size="):
            return int(arg.partition("=")[2])
    return 1
