"""Conformance: PrefixShadow against vLLM's own KV cache manager (its block pool, free
queue, block hashes and null block, imported from the installed vLLM), under the same
submissions, ends and lookups (model-based, as tests/prop/test_prefix_shadow_prop.py).

vLLM is driven the way its scheduler drives it, at the shadow's granularity: waiting
requests start in order while ``allocate_slots`` admits their whole prompt (the hit taken
from ``get_computed_blocks``), and an ending request decodes its output one token a step
(its last token never computed: the request ends when it is sampled) as long as a block
is free, then is freed. The shadow has one block less than the pool it models: vLLM's
null block. In-process (vLLM is imported when the test runs: seconds), so `make test-slow`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dynarl.sched import PrefixShadow

pytestmark = [pytest.mark.engines, pytest.mark.slow]

SIZE, CAPACITY, MAX_LEN = 2, 6, 4096
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=12)
IDS = st.sampled_from("abcd")


def _vllm() -> SimpleNamespace:
    """What the test takes from vLLM, imported when it runs (not when it is collected: the
    import takes seconds)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    return SimpleNamespace(
        torch=torch, SamplingParams=SamplingParams, sha256=sha256, utils=kv_cache_utils,
        KVCacheManager=KVCacheManager, FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec, Request=Request,
    )  # fmt: skip


class VllmPool:
    """vLLM's KV cache manager with ``capacity + 1`` blocks, and a waiting queue."""

    def __init__(self, size: int, capacity: int) -> None:
        v = _vllm()
        v.utils.init_none_hash(v.sha256)
        spec = v.FullAttentionSpec(
            block_size=size, num_kv_heads=1, head_size=1, dtype=v.torch.float32
        )
        config = v.KVCacheConfig(
            num_blocks=capacity + 1,
            kv_cache_tensors=[],
            kv_cache_groups=[v.KVCacheGroupSpec(["layer"], spec)],
        )
        self.manager = v.KVCacheManager(
            config, max_model_len=MAX_LEN, scheduler_block_size=size,
            hash_block_size=size, enable_caching=True,
        )  # fmt: skip
        self.hasher = v.utils.get_request_block_hasher(size, v.sha256)
        self.vllm = v
        self.waiting: list[Any] = []
        self.running: dict[str, Any] = {}

    def request(self, name: str, tokens: list[int]) -> Any:
        return self.vllm.Request(
            request_id=name, prompt_token_ids=tokens,
            sampling_params=self.vllm.SamplingParams(max_tokens=MAX_LEN), pooling_params=None,
            block_hasher=self.hasher,
        )  # fmt: skip

    def cached(self, tokens: list[int]) -> int:
        hit: int = self.manager.get_computed_blocks(self.request("probe", tokens))[1]
        return hit

    def admit(self) -> dict[str, int]:
        started = {}
        while self.waiting:
            request = self.waiting[0]
            blocks, hit, _ = self.manager.get_computed_blocks(request)
            if self.manager.allocate_slots(
                request, request.num_tokens - hit, hit, blocks, full_sequence_must_fit=True
            ) is None:  # fmt: skip
                break
            self.waiting.pop(0)
            request.num_computed_tokens = request.num_tokens
            self.running[request.request_id] = request
            started[request.request_id] = hit
        return started

    def finish(self, name: str, output: list[int] | None) -> dict[str, int]:
        request = self.running.pop(name)
        for token in (output or [])[:-1]:
            request.append_output_token_ids(token)
            if self.manager.allocate_slots(request, 1) is None:
                break
            request.num_computed_tokens += 1
        self.manager.free(request)
        return self.admit()


class Conformance(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shadow = PrefixShadow(block_size=SIZE, capacity_blocks=CAPACITY)
        self.vllm = VllmPool(SIZE, CAPACITY)
        self.prompts: dict[str, list[int]] = {}
        self.contexts: list[list[int]] = []
        """Finished sequences, which a next turn extends."""

    @rule(name=IDS, tokens=PROMPTS)
    def submit(self, name: str, tokens: list[int]) -> None:
        if name in self.prompts:
            return
        self.prompts[name] = tokens
        self.vllm.waiting.append(self.vllm.request(name, tokens))
        assert self.shadow.submit(name, tokens) == self.vllm.admit()

    @precondition(lambda self: bool(self.contexts))
    @rule(name=IDS, data=st.data(), observation=st.lists(st.integers(0, 2), max_size=4))
    def next_turn(self, name: str, data: st.DataObject, observation: list[int]) -> None:
        self.submit(name, data.draw(st.sampled_from(self.contexts)) + observation)

    @precondition(lambda self: bool(self.vllm.running))
    @rule(data=st.data(), output=st.none() | st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def finish(self, data: st.DataObject, output: list[int] | None) -> None:
        name = data.draw(st.sampled_from(sorted(self.vllm.running)))
        tokens = None if output is None else self.prompts[name] + output
        if tokens is not None:
            self.contexts.append(tokens)
        assert self.shadow.finish(name, tokens) == self.vllm.finish(name, output)
        del self.prompts[name]

    @precondition(lambda self: not self.prompts)
    @rule()
    def reset(self) -> None:
        assert self.vllm.manager.reset_prefix_cache()
        self.shadow.clear()

    @rule(tokens=PROMPTS)
    def lookup(self, tokens: list[int]) -> None:
        assert self.shadow.cached(tokens) == self.vllm.cached(tokens)

    @invariant()
    def same_free_blocks(self) -> None:
        assert self.shadow.free_blocks == self.vllm.manager.block_pool.get_num_free_blocks()
        assert self.shadow.waiting == tuple(r.request_id for r in self.vllm.waiting)


def test_the_shadow_conforms_to_vllms_kv_cache_manager() -> None:
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    run_state_machine_as_test(Conformance)
