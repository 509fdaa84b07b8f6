"""Expert layouts agree with Megatron's own experts module and its ``sharded_state_dict()``.

A real ``SequentialMLP`` (the local spec's experts, 4 experts) is built on CPU for every
rank of an (ep, etp) layout, its groups stand-ins that answer ``rank()`` and ``size()`` (all
the module and its state dict ask of them; torch.distributed is reported initialised so
that Megatron asks them at all). Every rank's module must describe the same
global model, name its experts by global index, and hold exactly the shards (expert axis
included) that :func:`trainer_layout` places on that rank.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from stub_group import StubGroup

from dynarl.backends._cpu_compat import apply_cpu_shim
from dynarl.migrate import LayoutSpec, param_names, param_specs, trainer_layout
from dynarl.migrate._megatron_layout import sharded_state_dict_mismatches

apply_cpu_shim()

# Importing Megatron's optimizer package (through megatron.core) compiles helpers with
# torch.jit (deprecated in torch 2.13): third-party noise.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
    warnings.filterwarnings("ignore", "The following imports from `dynamic_context.py`")
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

EXPERTS = 4
PREFIX = "decoder.layers.0.mlp.experts."


class Wrapped(torch.nn.Module):
    """``decoder.layers.0.mlp.experts`` around one experts module, with its state dict."""

    def __init__(self, experts: SequentialMLP) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.decoder.layers[0].mlp = torch.nn.Module()
        self.decoder.layers[0].mlp.experts = experts

    def sharded_state_dict(self, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        experts = self.decoder.layers[0].mlp.experts
        return dict(experts.sharded_state_dict(prefix=PREFIX, metadata=metadata))


def experts_on(spec: LayoutSpec, rank: int, *, glu: bool) -> Wrapped:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=16,
        use_cpu_initialization=True,
        tensor_model_parallel_size=spec.tp,
        expert_model_parallel_size=spec.ep,
        expert_tensor_parallel_size=spec.etp,
        sequence_parallel=spec.sequence_parallel,
        add_bias_linear=False,
        gated_linear_unit=glu,
        cuda_graph_scope=[],  # the default ("full") warns that it is deprecated
    )
    groups = ProcessGroupCollection(
        ep=StubGroup(spec.coord(rank, "ep"), spec.ep),
        expt_tp=StubGroup(spec.coord(rank, "etp"), spec.etp),
        expt_dp=StubGroup(spec.coord(rank, "edp"), spec.edp),
    )
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # Expert TP 1 under a sequence-parallel TP 2: Megatron warns that the experts'
        # linears do without it, as they should.
        warnings.filterwarnings("ignore", "`sequence_parallel` is set to `True`, but tensor")
        experts = SequentialMLP(EXPERTS // spec.ep, config, submodules, pg_collection=groups)
    return Wrapped(experts)


SPECS = {
    "ep2-etp1": LayoutSpec(ranks=(0, 1), dp=2, expert_parallel=2),
    "ep2-etp2": LayoutSpec(
        ranks=(0, 1, 2, 3), tp=2, dp=2, expert_parallel=2, sequence_parallel=True
    ),
    "ep2-etp1-tp2": LayoutSpec(
        ranks=(3, 2, 1, 0),
        tp=2,
        dp=2,
        expert_parallel=2,
        expert_tensor_parallel=1,
        sequence_parallel=True,
    ),
    "ep1-tp2": LayoutSpec(ranks=(0, 1), tp=2, sequence_parallel=True),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_expert_shards_match_megatrons_sharded_state_dict(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Megatron sizes a layer's split as 1 unless torch.distributed is initialised; the
    # stand-in groups answer for it, no collective is called.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    spec = SPECS[name]
    described = [param_specs(experts_on(spec, r, glu=True), tp=spec.tp) for r in spec.ranks]
    assert all(d == described[0] for d in described)
    assert {p.expert for p in described[0]} == set(range(EXPERTS))
    assert described[0][1].name == f"{PREFIX}local_experts.0.linear_fc2.weight"
    assert described[0][0].tp_stride == 2  # the GLU fc1, split in two halves per rank
    metadata = {"dp_cp_group": StubGroup(0, 1)}
    for rank in spec.ranks:
        model = experts_on(spec, rank, glu=False)  # stride 1: the state dict can say it
        layout = trainer_layout(param_specs(model, tp=spec.tp), spec)
        assert sharded_state_dict_mismatches(model, layout, rank, metadata=metadata) == []
        first = spec.coord(rank, "ep") * EXPERTS // spec.ep
        names = [g for _, g, _ in param_names(model)]
        assert names[0] == f"{PREFIX}local_experts.{first}.linear_fc1.weight"
