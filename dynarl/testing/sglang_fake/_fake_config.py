"""Configuration of :class:`~dynarl.testing.FakeSGLangServer`: the server arguments it models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FakeSGLangConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FakeSGLangConfig:
    """What a fake SGLang server is "launched" with (the ``launch_server`` flags it models)."""

    host: str = "127.0.0.1"
    """Address to bind; loopback only in tests."""
    port: int = 0
    """Port to bind; 0 picks a free one."""
    model_path: str = "dynarl/fake-model"
    """Reported by ``/model_info``."""
    step_interval_s: float | None = 0.002
    """Simulated time of one scheduler iteration (each running request gets one token per
    iteration); None: iterations run only when a test calls ``FakeSGLangServer.step()``."""
    max_running_requests: int = 64
    """``--max-running-requests``."""
    max_total_num_tokens: int = 4096
    """``--max-total-tokens``: KV pool capacity in tokens (``token_usage`` denominator)."""
    context_length: int = 2048
    """``--context-length``: prompt + ``max_new_tokens`` limit."""
    enable_priority_scheduling: bool = False
    """``--enable-priority-scheduling``: a higher ``priority`` is admitted first."""
    schedule_low_priority_values_first: bool = False
    """``--schedule-low-priority-values-first``: a lower ``priority`` is admitted first."""
    default_priority_value: int | None = None
    """``--default-priority-value``."""
    abort_on_priority_when_disabled: bool = False
    """``--abort-on-priority-when-disabled``."""
    disable_priority_preemption: bool = False
    """``--disable-priority-preemption``."""
    priority_scheduling_preemption_threshold: int = 10
    """``--priority-scheduling-preemption-threshold``."""
    disable_radix_cache: bool = False
    """``--disable-radix-cache``: no prefix reuse, ``cached_tokens`` stays 0."""
    enable_memory_saver: bool = True
    """``--enable-memory-saver``: without it memory release/resume fail."""
    enable_weights_cpu_backup: bool = False
    """``--enable-weights-cpu-backup``: without it released weights come back undefined
    (zeros here), so they must be synced again."""
    api_key: str | None = None
    """``--api-key``."""
    admin_api_key: str | None = None
    """``--admin-api-key``."""
    tp_size: int = 1
    """``--tp-size``: shards the weights-checker report; the fake joins a weight-update
    group only with 1."""
    weight_version: str = "default"
    """``--weight-version`` (initial)."""
    checksum_device: Literal["cuda", "cpu"] = "cuda"
    """Which SGLang tensor hash ``/weights_checker`` uses: the CUDA kernel's (what a GPU
    server reports) or the CPU SHA-256 one."""
    group_timeout_s: float = 60.0
    """Deadline for joining and using a weight-update process group."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.step_interval_s is not None and self.step_interval_s <= 0:
            raise ValueError(f"step_interval_s must be > 0 or None, got {self.step_interval_s}")
        for name in (
            "max_running_requests",
            "max_total_num_tokens",
            "context_length",
            "tp_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("priority_scheduling_preemption_threshold must be >= 0")
        if self.group_timeout_s <= 0:
            raise ValueError(f"group_timeout_s must be > 0, got {self.group_timeout_s}")
