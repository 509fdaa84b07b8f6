"""Weight sync pieces that need no process group: Megatron ↔ HF layout, buckets, checksums."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.backends.hf_layout import (
    GPTLayout,
    hf_to_megatron,
    megatron_to_hf,
    merge_gated_fc1,
    merge_qkv,
    partition_dim,
    split_gated_fc1,
    split_qkv,
)
from dynarl.backends.sglang import (
    Bucket,
    TensorMeta,
    expected_checksums,
    overall_checksum,
    sglang_rank_params,
)
from dynarl.backends.sglang._buckets import (
    flatten_bucket,
    plan_buckets,
    tensor_meta,
    unflatten_bucket,
)
from dynarl.backends.sglang._weight_check import cpu_tensor_hash, cuda_tensor_hash

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64]


@st.composite
def layouts(draw: st.DrawFn) -> GPTLayout:
    groups = draw(st.integers(1, 4))
    return GPTLayout(
        num_attention_heads=groups * draw(st.integers(1, 3)),
        num_query_groups=groups,
        head_dim=draw(st.sampled_from([1, 2, 4])),
        fc1_tp_size=draw(st.sampled_from([1, 2, 4])),
        te_layernorm=draw(st.booleans()),
    )


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _megatron_model(
    layout: GPTLayout, hidden: int, ffn_per_rank: int, seed: int
) -> dict[str, torch.Tensor]:
    qkv_rows = layout.num_query_groups * (layout.heads_per_group + 2) * layout.head_dim
    ffn = ffn_per_rank * layout.fc1_tp_size
    q_dim = layout.num_attention_heads * layout.head_dim
    ln = (
        "self_attention.linear_qkv.layer_norm_weight"
        if layout.te_layernorm
        else "input_layernorm.weight"
    )
    mlp_ln = (
        "mlp.linear_fc1.layer_norm_weight" if layout.te_layernorm else "pre_mlp_layernorm.weight"
    )
    shapes = {
        "embedding.word_embeddings.weight": (11, hidden),
        "decoder.layers.0." + ln: (hidden,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (qkv_rows, hidden),
        "decoder.layers.0.self_attention.linear_qkv.bias": (qkv_rows,),
        "decoder.layers.0.self_attention.linear_proj.weight": (hidden, q_dim),
        "decoder.layers.0.self_attention.q_layernorm.weight": (layout.head_dim,),
        "decoder.layers.0.self_attention.k_layernorm.weight": (layout.head_dim,),
        "decoder.layers.0." + mlp_ln: (hidden,),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * ffn, hidden),
        "decoder.layers.0.mlp.linear_fc2.weight": (hidden, ffn),
        "decoder.final_layernorm.weight": (hidden,),
        "output_layer.weight": (11, hidden),
    }
    return {
        name: _random(shape, torch.bfloat16, seed + i)
        for i, (name, shape) in enumerate(shapes.items())
    }


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), hidden=st.integers(1, 6), ffn=st.integers(1, 3), seed=st.integers(0, 99))
def test_megatron_to_hf_round_trips_bit_for_bit(
    layout: GPTLayout, hidden: int, ffn: int, seed: int
) -> None:
    megatron = _megatron_model(layout, hidden, ffn, seed)
    hf = megatron_to_hf(megatron, layout, layer_offset=3)
    assert "model.layers.3.self_attn.q_proj.weight" in hf and "lm_head.weight" in hf
    back = hf_to_megatron(hf, layout, layer_offset=3)
    assert back.keys() == megatron.keys()
    for name, tensor in megatron.items():
        assert torch.equal(back[name], tensor), name
    again = megatron_to_hf(back, layout, layer_offset=3)
    assert all(torch.equal(again[name], tensor) for name, tensor in hf.items())


def test_qkv_split_follows_megatrons_group_interleaving() -> None:
    layout = GPTLayout(num_attention_heads=4, num_query_groups=2, head_dim=3)
    # Row label: 100 * group + 10 * slot + position, where slots 0-1 are the group's query
    # heads, 2 its key and 3 its value (SelfAttention.get_query_key_value_tensors).
    labels = torch.tensor(
        [100 * g + 10 * s + d for g in range(2) for s in range(4) for d in range(3)]
    )
    q, k, v = split_qkv(labels, layout)
    assert q.tolist() == [
        100 * g + 10 * s + d for g in range(2) for s in range(2) for d in range(3)
    ]
    assert k.tolist() == [100 * g + 20 + d for g in range(2) for d in range(3)]
    assert v.tolist() == [100 * g + 30 + d for g in range(2) for d in range(3)]
    assert torch.equal(merge_qkv(q, k, v, layout), labels)


def test_gated_fc1_is_split_per_tensor_parallel_rank() -> None:
    gate = torch.arange(8).reshape(8, 1)
    up = 100 + torch.arange(8).reshape(8, 1)
    # Rank r of tp=2 holds [gate_r; up_r]; gathering concatenates the ranks.
    gathered = torch.cat([gate[:4], up[:4], gate[4:], up[4:]])
    got_gate, got_up = split_gated_fc1(gathered, tp_size=2)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)
    assert torch.equal(merge_gated_fc1(gate, up, tp_size=2), gathered)
    wrong_gate, _ = split_gated_fc1(gathered, tp_size=1)
    assert not torch.equal(wrong_gate, gate)


def test_partition_dims_and_unknown_names() -> None:
    assert partition_dim("decoder.layers.2.self_attention.linear_qkv.weight") == 0
    assert partition_dim("decoder.layers.2.mlp.linear_fc2.weight") == 1
    assert partition_dim("embedding.word_embeddings.weight") == 0
    assert partition_dim("decoder.layers.2.input_layernorm.weight") is None
    layout = GPTLayout(num_attention_heads=2, num_query_groups=1, head_dim=2)
    with pytest.raises(ValueError, match="no HF name"):
        megatron_to_hf({"decoder.layers.0.router.weight": torch.zeros(1)}, layout)
    with pytest.raises(ValueError, match="missing"):
        hf_to_megatron({"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 1)}, layout)


@st.composite
def tensor_sets(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    count = draw(st.integers(1, 8))
    tensors = {}
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        tensors[f"t{i}"] = _random(shape, draw(st.sampled_from(DTYPES)), i)
    return tensors


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), limit=st.integers(1, 300))
def test_buckets_hold_every_tensor_once_aligned_and_round_trip(
    tensors: dict[str, torch.Tensor], limit: int
) -> None:
    metas = [tensor_meta(name, tensor) for name, tensor in tensors.items()]
    buckets = plan_buckets(metas, max_bucket_bytes=limit)
    names = [name for bucket in buckets for name in bucket.names]
    assert sorted(names) == sorted(tensors)
    for bucket in buckets:
        assert bucket.nbytes <= limit or len(bucket.tensors) == 1
        flat = flatten_bucket(bucket, tensors)
        assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
        for name, tensor in unflatten_bucket(bucket, flat):
            assert tensor.dtype == tensors[name].dtype
            assert torch.equal(
                tensor.reshape(-1).view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8)
            )


def test_bucket_refuses_what_sglang_refuses() -> None:
    with pytest.raises(ValueError, match="unaligned"):
        Bucket(
            tensors=(
                TensorMeta(name="a", dtype="int8", shape=(1,)),
                TensorMeta(name="b", dtype="float32", shape=(1,)),
            )
        )
    with pytest.raises(ValueError, match="unknown torch dtype"):
        TensorMeta(name="a", dtype="floot", shape=(1,))
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([tensor_meta("a", torch.zeros(1))] * 2, max_bucket_bytes=8)


def test_cpu_hash_is_sha256_prefix_of_the_bytes() -> None:
    tensor = torch.arange(10, dtype=torch.bfloat16)
    digest = hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).digest()
    assert cpu_tensor_hash(tensor) == int.from_bytes(digest[:8], "big")


def _kernel_by_the_letter(tensor: torch.Tensor) -> int:
    """gpu_tensor_hash followed one word at a time, in Python integers."""
    m32, m64 = 0xFFFFFFFF, (1 << 64) - 1
    data = tensor.contiguous().reshape(-1).view(torch.uint8).tolist()
    data += [0] * (-len(data) % 4)
    words = [int.from_bytes(bytes(data[i : i + 4]), "little") for i in range(0, len(data), 4)]

    def fmix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & m32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & m32
        return x ^ (x >> 16)

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & m32

    seed = 0x243F6A88
    s1, s2 = seed & m32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & m32
    tiles = [words[i : i + 8192] for i in range(0, len(words), 8192)]
    total = 0
    for t, tile in enumerate(tiles):
        h1 = h2 = 0
        for j, word in enumerate(tile):
            i = t * 8192 + j
            h1 = (h1 + fmix(word ^ (((i * 0x27D4EB2D + s1) & m32) ^ rotl(i, 15)))) & m32
            h2 = (h2 + fmix(word ^ (((i * 0x165667B1 + s2) & m32) ^ rotl(i, 13)))) & m32
        nbytes = (len(words) * 4) & m32
        total = (total + ((fmix(h1 ^ nbytes) << 32) | fmix(h2 ^ nbytes))) & m64
    x = total
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m64
    return x ^ (x >> 31)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(7, dtype=torch.int8),
        torch.linspace(-3, 3, 9000).to(torch.float32),
        torch.ones(3, 5, dtype=torch.bfloat16),
        torch.zeros(0),
    ],
    ids=["unaligned-bytes", "two-tiles", "bf16", "empty"],
)
def test_vectorised_cuda_hash_matches_the_kernel_followed_word_by_word(
    tensor: torch.Tensor,
) -> None:
    expected = 0 if tensor.numel() == 0 else _kernel_by_the_letter(tensor)
    assert cuda_tensor_hash(tensor) == expected


def test_sglang_layout_fuses_and_shards_like_its_loader() -> None:
    hf = {
        "model.embed_tokens.weight": torch.arange(70 * 2, dtype=torch.float32).reshape(70, 2),
        "model.layers.0.self_attn.q_proj.weight": torch.full((4, 2), 1.0),
        "model.layers.0.self_attn.k_proj.weight": torch.full((2, 2), 2.0),
        "model.layers.0.self_attn.v_proj.weight": torch.full((2, 2), 3.0),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(8.0).reshape(2, 4),
        "model.layers.0.mlp.gate_proj.weight": torch.full((4, 2), 4.0),
        "model.layers.0.mlp.up_proj.weight": torch.full((4, 2), 5.0),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),
        "model.norm.weight": torch.ones(2),
    }
    (single,) = sglang_rank_params(hf)
    assert (
        single["model.layers.0.self_attn.qkv_proj.weight"][:, 0].tolist()
        == [1] * 4 + [2] * 2 + [3] * 2
    )
    assert single["model.layers.0.mlp.gate_up_proj.weight"][:, 0].tolist() == [4] * 4 + [5] * 4
    assert single["model.embed_tokens.weight"].shape == (128, 2)  # padded to 64 with zeros
    assert not single["model.embed_tokens.weight"][70:].any()
    assert not any("inv_freq" in name for name in single)
    first, second = sglang_rank_params(hf, tp_size=2)
    assert first["model.layers.0.self_attn.qkv_proj.weight"][:, 0].tolist() == [1, 1, 2, 3]
    assert torch.equal(
        second["model.layers.0.self_attn.o_proj.weight"],
        hf["model.layers.0.self_attn.o_proj.weight"][:, 2:],
    )
    assert torch.equal(
        second["model.embed_tokens.weight"][:6], hf["model.embed_tokens.weight"][64:]
    )
    replicated = sglang_rank_params(hf, tp_size=4, num_key_value_heads=2)
    assert [p["model.layers.0.self_attn.qkv_proj.weight"].shape[0] for p in replicated] == [3] * 4


def test_expected_checksums_follow_sglangs_formulas() -> None:
    hf = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(64, 4)}
    expected = expected_checksums(hf, device="cpu")
    (checksums,) = expected.per_rank
    assert checksums["model.norm.weight"] == f"{cpu_tensor_hash(torch.ones(4)):016x}"
    assert expected.per_gpu == (overall_checksum(checksums),)
    assert expected.per_engine == hashlib.sha256(expected.per_gpu[0].encode()).hexdigest()
    as_bf16 = expected_checksums(hf, device="cpu", dtype=torch.bfloat16)
    assert as_bf16.per_engine != expected.per_engine
