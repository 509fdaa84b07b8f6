"""Serve a fake SGLang server until SIGTERM: ``python -m dynarl.testing.sglang_fake``.

Accepts the ``sglang.launch_server`` flags the fake models (others are ignored, as a
stand-in for a real server in launcher tests), plus ``--fake-weights PATH`` (a
``torch.save``'d dict of HF-named tensors) and ``--fake-step-interval SECONDS``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import torch

from dynarl.testing.sglang_fake._fake_config import FakeSGLangConfig
from dynarl.testing.sglang_fake._server import FakeSGLangServer


def _parse(argv: list[str] | None = None) -> tuple[FakeSGLangConfig, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--model-path", default="dynarl/fake-model")
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--enable-priority-scheduling", action="store_true")
    parser.add_argument("--schedule-low-priority-values-first", action="store_true")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--fake-weights")
    parser.add_argument("--fake-step-interval", type=float, default=0.002)
    args, _ignored = parser.parse_known_args(argv)
    config = FakeSGLangConfig(
        host=args.host,
        port=args.port,
        model_path=args.model_path,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        tp_size=args.tp_size,
        max_running_requests=args.max_running_requests,
        max_total_num_tokens=args.max_total_tokens,
        context_length=args.context_length,
        enable_priority_scheduling=args.enable_priority_scheduling,
        schedule_low_priority_values_first=args.schedule_low_priority_values_first,
        enable_memory_saver=args.enable_memory_saver,
        weight_version=args.weight_version,
        step_interval_s=args.fake_step_interval,
    )
    return config, args.fake_weights


async def _serve(config: FakeSGLangConfig, weights_path: str | None) -> None:
    weights = torch.load(weights_path, weights_only=True) if weights_path else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with FakeSGLangServer(config, weights=weights):
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and serve until SIGTERM or SIGINT."""
    config, weights_path = _parse(argv)
    asyncio.run(_serve(config, weights_path))


if __name__ == "__main__":
    main()
