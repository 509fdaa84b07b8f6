"""How SGLang 0.5.23's FastAPI app shapes its replies, for the fake's handlers."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from dynarl.testing.sglang_fake._scheduler import FakeScheduler

__all__ = ["http_error", "json_reply", "load_snapshot", "validation_error", "value_error"]


def json_reply(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def validation_error(message: str) -> web.Response:
    """FastAPI ``RequestValidationError`` as SGLang renders it (status 400)."""
    body = {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
    return json_reply(body, 400)


def http_error(status: int, message: str) -> web.Response:
    """FastAPI ``HTTPException`` as SGLang renders it."""
    body = {
        "object": "error",
        "message": message,
        "type": str(status),
        "param": None,
        "code": status,
    }
    return json_reply(body, status)


def value_error(message: str, status: int = 400) -> web.Response:
    """``_create_error_response``: ``{"error": {"message": ...}}``."""
    return json_reply({"error": {"message": message}}, status)


def load_snapshot(scheduler: FakeScheduler, weight_gb: float) -> dict[str, Any]:
    """One DP rank's ``LoadSnapshot.to_dict()`` with the sections SGLang fills."""
    now = scheduler.clock()
    window = [(t, n) for t, n in scheduler.recent_tokens if now - t <= 1.0]
    span = (now - window[0][0]) if len(window) > 1 else 0.0
    throughput = sum(n for _, n in window[1:]) / span if span > 0 else 0.0
    used = scheduler.num_used_tokens
    waiting_tokens = sum(req.seqlen for req in scheduler.waiting)
    capacity = scheduler.config.max_total_num_tokens
    return {
        "timestamp": now,
        "dp_rank": 0,
        "num_running_reqs": len(scheduler.running),
        "num_waiting_reqs": len(scheduler.waiting),
        "num_waiting_uncached_tokens": waiting_tokens,
        "num_used_tokens": used,
        "num_total_tokens": used + waiting_tokens,
        "num_active_tokens": used + waiting_tokens,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": scheduler.config.max_running_requests,
        "token_usage": round(used / capacity, 4),
        "gen_throughput": round(throughput, 2),
        "cache_hit_rate": round(scheduler.cache_hit_rate, 4),
        "utilization": 0.0,
        "total_prefill_uncached_tokens": scheduler.total_prefill_uncached,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
        "memory": {
            "weight_gb": round(weight_gb, 3),
            "kv_cache_gb": 0.0,
            "graph_gb": 0.0,
            "token_capacity": capacity,
        },
        "disaggregation": {
            "mode": "null",
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {
            "waiting": len(scheduler.waiting),
            "grammar": 0,
            "paused": len(scheduler.running) if scheduler.engine_paused else 0,
            "retracted": sum(1 for req in scheduler.waiting if req.num_retractions),
            "prealloc_ready": 0,
        },
    }
