"""MoE models in the Megatron trainer, without processes: the HF name map of routers and
experts, the MoE fields of the model config, the layouts a MoE model takes, sequence-parallel
padding and norms.

The name map is checked against the parameters of a real Megatron MoE model (described on
the ``meta`` device): every parameter gets an HF name, the experts and routers Qwen-MoE's,
and the round trip is bitwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dynarl.backends._grpo import TrainSample
from dynarl.backends.megatron import GPTModelConfig, describe, from_hf, hf_config, to_hf
from dynarl.backends.megatron._hf_moe import moe_from_hf
from dynarl.backends.megatron._layer_spec import SequenceParallelNorm
from dynarl.backends.megatron._layout_rules import check_layout_spec, model_layout_spec
from dynarl.backends.megatron._micro_batches import micro_tensors

MOE = GPTModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
)
CPU = torch.device("cpu")


def test_moe_weights_map_onto_qwen_moe_names_and_back_bitwise() -> None:
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in describe(MOE)}
    hf = to_hf(full, MOE)
    experts = {n for n in hf if ".mlp.experts." in n}
    assert len(experts) == 2 * 4 * 3
    assert hf["model.layers.1.mlp.gate.weight"].shape == (4, 32)
    assert hf["model.layers.0.mlp.experts.2.gate_proj.weight"].shape == (48, 32)
    assert hf["model.layers.0.mlp.experts.2.up_proj.weight"].shape == (48, 32)
    assert hf["model.layers.0.mlp.experts.2.down_proj.weight"].shape == (32, 48)
    assert "model.layers.0.post_attention_layernorm.weight" in hf
    fc1 = full["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(hf["model.layers.0.mlp.experts.2.gate_proj.weight"], fc1[:48])
    assert torch.equal(hf["model.layers.0.mlp.experts.2.up_proj.weight"], fc1[48:])
    assert torch.equal(
        hf["model.layers.1.mlp.experts.3.down_proj.weight"],
        full["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"],
    )
    back = from_hf(hf, MOE)
    assert back.keys() == full.keys()
    assert all(torch.equal(back[n], full[n]) for n in full)


def test_moe_names_are_refused_where_they_do_not_belong() -> None:
    dense = GPTModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128
    )
    router = {"decoder.layers.0.mlp.router.weight": torch.zeros(4, 32)}
    with pytest.raises(ValueError, match="no HF name for Megatron tensor"):
        to_hf(router, dense)
    with pytest.raises(ValueError, match="gate_proj and up_proj come together"):
        moe_from_hf({"model.layers.0.mlp.experts.1.gate_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="num_experts: no HF config"):
        hf_config(MOE)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"num_experts": 0}, "num_experts must be >= 1"),
        ({"num_experts": 4, "moe_router_topk": 5}, "moe_router_topk must be in"),
        ({"num_experts": 4, "moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size must be >= 1"),
    ],
)
def test_bad_moe_fields_are_refused_by_name(fields: dict[str, int], words: str) -> None:
    base = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 8}
    with pytest.raises(ValueError, match=words):
        GPTModelConfig(vocab_size=16, **base, **fields)  # type: ignore[arg-type]


def test_moe_layouts_get_sequence_parallel_with_tp_and_refuse_it_missing() -> None:
    assert model_layout_spec(MOE, (0, 1), tp=2).sequence_parallel
    assert not model_layout_spec(MOE, (0, 1), dp=2, expert_parallel=2).sequence_parallel
    dense = GPTModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128
    )
    assert not model_layout_spec(dense, (0, 1), tp=2).sequence_parallel
    without = model_layout_spec(MOE, (0, 1), tp=2, sequence_parallel=False)
    with pytest.raises(ValueError, match="sequence_parallel: a MoE model with tp > 1"):
        check_layout_spec(MOE, without, CPU)
    expert = model_layout_spec(MOE, (0, 1), dp=2, expert_parallel=2)
    check_layout_spec(MOE, expert, CPU)
    with pytest.raises(ValueError, match="expert_parallel > 1 runs on the CPU trainer only"):
        check_layout_spec(MOE, expert, torch.device("cuda"))


def test_sequence_parallel_pads_to_a_multiple_of_tp_and_masks_the_padding() -> None:
    samples = [
        TrainSample(tokens=(1, 2, 3, 4, 5), loss_mask=(True,) * 4, advantage=1.0),
        TrainSample(tokens=(6, 7, 8), loss_mask=(True,) * 2, advantage=0.0),
    ]
    spec = model_layout_spec(MOE, (0, 1, 2, 3), tp=4)
    tokens, mask = micro_tensors(samples, spec, device=CPU)
    assert tokens.shape == (2, 8) and mask.shape == (2, 7)
    assert tokens[0, :5].tolist() == [1, 2, 3, 4, 5] and tokens[0, 5:].tolist() == [0, 0, 0]
    assert mask.sum().item() == 6
    plain = model_layout_spec(MOE, (0, 1), dp=2, expert_parallel=2)
    tokens, _ = micro_tensors(samples, plain, device=CPU, length=7)
    assert tokens.shape == (2, 7)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norms_carry_the_sequence_parallel_mark(kind: str) -> None:
    on = SequenceParallelNorm(SimpleNamespace(normalization=kind, sequence_parallel=True), 8)
    off = SequenceParallelNorm(SimpleNamespace(normalization=kind, sequence_parallel=False), 8)
    assert type(on).__name__ == kind
    assert all(p.sequence_parallel for p in on.parameters())  # type: ignore[attr-defined]
    assert not any(p.sequence_parallel for p in off.parameters())  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="RMSNorm or LayerNorm only"):
        SequenceParallelNorm(SimpleNamespace(normalization="L2Norm", sequence_parallel=True), 8)


@pytest.mark.parametrize(
    ("tp", "dp", "pp", "ep", "etp"),
    [(1, 2, 1, 2, 1), (2, 2, 1, 2, 2), (2, 2, 2, 2, 1), (1, 4, 2, 2, 2), (2, 1, 1, 1, 2)],
)
def test_expert_norm_groups_are_megatrons(tp: int, dp: int, pp: int, ep: int, etp: int) -> None:
    """``tp_ep_pp`` (where expert gradient norms are summed) as Megatron's expert rank
    generator lists its ``tp-ep-pp`` groups."""
    from megatron.core.parallel_state import RankGenerator

    from dynarl.migrate import LayoutSpec

    ranks = tuple(reversed(range(tp * dp * pp)))
    spec = LayoutSpec(
        ranks=ranks, tp=tp, dp=dp, pp=pp, expert_parallel=ep, expert_tensor_parallel=etp
    )
    generator = RankGenerator(tp=etp, ep=ep, dp=spec.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    want = [tuple(ranks[i] for i in group) for group in generator.get_ranks("tp-ep-pp")]
    assert spec.group_ranks("tp_ep_pp") == want
