"""``VLLMEngine``: one vLLM server as the engine the serving role drives
(:class:`dynarl.backends._engine.Engine`).

It launches the server (:class:`VLLMServer`, one per device) or attaches to one already
running (``url``), and maps dynarl's requests, pause modes and load onto vLLM's: pause
``keep``/``abort``/``wait`` are vLLM's own (no ``retract``); utilization is the larger of KV
use and running requests over ``max_num_seqs``. Runs on the caller's event loop.
"""

from __future__ import annotations

from dataclasses import replace

from dynarl.backends._engine import (
    EngineLoad,
    EngineOutput,
    EngineRequest,
    PauseMode,
    ScoreRequest,
    VersionSpan,
    check_scores,
)
from dynarl.backends._server_engine import ServerEngine
from dynarl.backends.vllm._client import VLLMClient, VLLMClientConfig
from dynarl.backends.vllm._launcher import VLLMServer, VLLMServerConfig
from dynarl.backends.vllm._wire import GenerateRequest, GenerateResult, SamplingParams
from dynarl.errors import BackendError

__all__ = ["VLLM_DEFAULT_MAX_NUM_SEQS", "VLLMEngine"]

VLLM_DEFAULT_MAX_NUM_SEQS = 256
"""vLLM 0.32's ``--max-num-seqs`` when none is given."""


class VLLMEngine(ServerEngine[VLLMServer, VLLMClient]):
    """One vLLM server: launched from ``server`` (stopped on :meth:`aclose`), or attached
    at ``url`` (left running). ``client`` overrides the client's deadlines and retries."""

    kind = "vllm"
    pause_modes: frozenset[PauseMode] = frozenset({"keep", "abort", "wait"})

    def __init__(
        self,
        *,
        server: VLLMServerConfig | None = None,
        url: str | None = None,
        max_num_seqs: int | None = None,
        client: VLLMClientConfig | None = None,
    ) -> None:
        super().__init__(server=VLLMServer(server) if server is not None else None, url=url)
        limit = max_num_seqs or (server.max_num_seqs if server is not None else None)
        self.max_num_seqs = limit or VLLM_DEFAULT_MAX_NUM_SEQS
        self._client_config = client

    def _open_client(self, url: str) -> VLLMClient:
        base = self._client_config or VLLMClientConfig(base_url=url)
        return VLLMClient(replace(base, base_url=url))

    async def generate(self, request: EngineRequest) -> EngineOutput:
        """Run ``request`` (an abort returns its partial output)."""
        result = await self.client.generate(_vllm_request(request))
        return _output(result)

    async def score(self, request: ScoreRequest) -> tuple[float, ...]:
        """Each token's log-prob after the first (vLLM's ``prompt_logprobs``)."""
        values = await self.client.score(
            request.request_id, request.token_ids, priority=request.priority
        )
        return check_scores(request, values)

    async def abort(self, request_id: str) -> None:
        """Abort one request by its id."""
        await self.client.abort(request_id)

    async def abort_all(self) -> None:
        """Abort every request the server holds."""
        await self.client.abort_all()

    async def pause(self, mode: PauseMode) -> None:
        """``/pause`` in ``mode``; ValueError for ``retract`` (vLLM has none)."""
        if mode not in self.pause_modes:
            raise ValueError(
                f"engine {self.name}: vLLM has no pause mode {mode!r}; it has "
                f"{sorted(self.pause_modes)}"
            )
        assert mode != "retract"
        await self.client.pause(mode)

    async def resume(self) -> None:
        """``/resume``."""
        await self.client.resume()

    async def load(self) -> EngineLoad:
        """``/metrics``, with ``max_num_seqs`` as the running limit."""
        load = await self.client.load()
        return EngineLoad(
            running=load.num_running,
            waiting=load.num_waiting,
            max_running=self.max_num_seqs,
            kv_usage=min(1.0, max(0.0, load.kv_cache_usage)),
            prefix_query_tokens=load.prefix_cache_queries,
            prefix_hit_tokens=load.prefix_cache_hits,
            preemptions=load.num_preemptions,
        )

    async def set_weight_version(self, version: str) -> None:
        """``/update_weight_version``: the label later tokens report."""
        await self.client.update_weight_version(version)

    async def weight_version(self) -> str:
        """``/weight_info``: the label in force."""
        return await self.client.weight_version()


def _vllm_request(request: EngineRequest) -> GenerateRequest:
    return GenerateRequest(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        sampling_params=SamplingParams(
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop_token_ids=list(request.stop_token_ids) or None,
            ignore_eos=request.ignore_eos,
        ),
        priority=request.priority,
    )


def _output(result: GenerateResult) -> EngineOutput:
    finish = result.finish_reason
    if finish not in ("stop", "length", "abort"):
        raise BackendError(f"vLLM request {result.request_id}: unknown finish_reason {finish!r}")
    return EngineOutput(
        request_id=result.request_id,
        token_ids=result.token_ids,
        logprobs=result.logprobs,
        finish=finish,  # type: ignore[arg-type]
        versions=tuple(VersionSpan(s.version, s.start, s.end) for s in result.weight_versions),
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
    )
