"""A weight push into a real vLLM engine, from a plain-torch HF model in this process.

The pusher hosts a gloo group that the server's worker joins through dynarl's worker
extension; a push of perturbed weights makes the engine's log-probs those of this process's
forward pass with the same weights (fp32 bound; log-probs, not argmax: a random tiny model
has near-ties), every token reports the version pushed, scoring the whole sequence
(:meth:`Engine.score`, what an inference component computes) gives this process's
teacher-forced log-prob of every token after the first, and a second push of the original
weights restores the original generation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from vllm_support import MAX_NUM_SEQS, greedy_request

from dynarl.backends.serving import EngineOutput, ScoreRequest
from dynarl.backends.vllm import VLLMEngine, VLLMServer, WeightPusher

pytestmark = pytest.mark.engines

LOGPROB_TOL = 1e-3
"""fp32: vLLM's CPU kernels and this process's eager forward round differently."""


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor plus seeded noise of a tenth of its own spread."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.1 * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in state.items()
    }


def forward_logprobs(
    model: torch.nn.Module, prompt: tuple[int, ...], out: EngineOutput
) -> list[float]:
    """This process's log-prob of each generated token, given everything before it."""
    ids = torch.tensor([list(prompt) + list(out.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    rows = logprobs[start : start + len(out.token_ids)]
    return rows.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()


def teacher_forced(model: torch.nn.Module, tokens: tuple[int, ...]) -> list[float]:
    """This process's log-prob of each of ``tokens`` after the first."""
    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[:-1]
    return rows.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def test_a_push_gives_the_pushed_weights_log_probs_and_a_second_restores(
    vllm_server: VLLMServer, tiny_model: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    original = safetensors.load_file(str(tiny_model / "model.safetensors"))
    pushed = perturbed(original, seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    model.load_state_dict(pushed)
    model.eval()
    request = greedy_request("push", 24, seed=3)

    scored: list[tuple[float, ...]] = []

    async def main() -> tuple[EngineOutput, EngineOutput, EngineOutput]:
        engine = VLLMEngine(url=vllm_server.url, max_num_seqs=MAX_NUM_SEQS)
        await engine.start()
        try:
            before = await engine.generate(request)
            async with WeightPusher([engine.client]) as pusher:
                report = await pusher.push(pushed, "1")
                assert report.num_tensors == len(pushed) and report.bytes_sent > 0
                after = await engine.generate(request)
                sequence = request.token_ids + after.token_ids
                scored.append(await engine.score(ScoreRequest(request_id="s", token_ids=sequence)))
                await pusher.push(original, "2")
                restored = await engine.generate(request)
        finally:
            await engine.set_weight_version("0")
            await engine.aclose()
        return before, after, restored

    before, after, restored = asyncio.run(main())
    assert after.token_versions() == ("1",) * len(after.token_ids)
    assert restored.token_versions() == ("2",) * len(restored.token_ids)
    assert after.logprobs != pytest.approx(before.logprobs, abs=LOGPROB_TOL)
    expected = forward_logprobs(model, request.token_ids, after)
    assert list(after.logprobs) == pytest.approx(expected, abs=LOGPROB_TOL)
    (scores,) = scored
    full = teacher_forced(model, request.token_ids + after.token_ids)
    assert list(scores) == pytest.approx(full, abs=LOGPROB_TOL)
    assert restored.token_ids == before.token_ids
    assert list(restored.logprobs) == pytest.approx(before.logprobs, abs=LOGPROB_TOL)
