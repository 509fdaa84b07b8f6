"""Benchmark: how long planning takes for large models and thousands of ranks.

A 32-layer GPT description (hidden 4096, vocab 32000: 293 parameters, 1,172 tensors with
the Adam state) is laid out and resharded between layouts of up to 2,048 ranks; the
layout builder and ``plan_reshard`` are timed separately (single process, pure Python).
Run: ``.venv/bin/python bench/reshard_plan.py``; the last line is one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

from dynarl.migrate import LayoutSpec, ParamSpec, Stage, plan_reshard, trainer_layout


def model(layers: int = 32, h: int = 4096, vocab: int = 32000) -> list[ParamSpec]:
    params = [ParamSpec(name="embedding", shape=(vocab, h), tp_dim=0, stage=Stage.FIRST)]
    for n in range(layers):
        params += [
            ParamSpec(name=f"layers.{n}.ln1", shape=(h,), layer=n),
            ParamSpec(name=f"layers.{n}.qkv", shape=(3 * h, h), tp_dim=0, layer=n),
            ParamSpec(name=f"layers.{n}.qkv_bias", shape=(3 * h,), tp_dim=0, layer=n),
            ParamSpec(name=f"layers.{n}.proj", shape=(h, h), tp_dim=1, layer=n),
            ParamSpec(name=f"layers.{n}.proj_bias", shape=(h,), layer=n),
            ParamSpec(name=f"layers.{n}.ln2", shape=(h,), layer=n),
            ParamSpec(name=f"layers.{n}.fc1", shape=(2 * 11008, h), tp_dim=0, tp_stride=2, layer=n),
            ParamSpec(name=f"layers.{n}.fc2", shape=(h, 11008), tp_dim=1, layer=n),
            ParamSpec(name=f"layers.{n}.fc2_bias", shape=(h,), layer=n),
        ]
    return [
        *params,
        ParamSpec(name="ln_f", shape=(h,), stage=Stage.LAST),
        ParamSpec(name="output", shape=(vocab, h), tp_dim=0, stage=Stage.LAST),
    ]


def spec(world: int, tp: int, pp: int, distopt: bool) -> LayoutSpec:
    return LayoutSpec(
        ranks=tuple(range(world)),
        tp=tp,
        pp=pp,
        dp=world // (tp * pp),
        distributed_optimizer=distopt,
    )


CASES = [
    ("64 ranks: tp8 pp2 dp4 -> tp4 pp4 dp4 distopt", spec(64, 8, 2, False), spec(64, 4, 4, True)),
    (
        "512 ranks: tp8 pp4 dp16 distopt -> tp4 pp8 dp16 distopt",
        spec(512, 8, 4, True),
        spec(512, 4, 8, True),
    ),
    ("2048 ranks: tp8 pp8 dp32 -> tp8 pp4 dp64", spec(2048, 8, 8, False), spec(2048, 8, 4, False)),
    (
        "2048 ranks: tp8 pp8 dp32 distopt -> tp4 pp8 dp64 distopt",
        spec(2048, 8, 8, True),
        spec(2048, 4, 8, True),
    ),
]


def main() -> None:
    params = model()
    out: dict[str, object] = {
        "num_params": len(params),
        "num_tensors": 4 * len(params),
        "cases": {},
    }
    for name, src_spec, dst_spec in CASES:
        began = time.perf_counter()
        src, dst = trainer_layout(params, src_spec), trainer_layout(params, dst_spec)
        layout_s = time.perf_counter() - began
        began = time.perf_counter()
        plan = plan_reshard(dst.tensor_map(), src.shards, dst.shards)
        plan_s = time.perf_counter() - began
        case = {
            "layout_s": round(layout_s, 2),
            "plan_s": round(plan_s, 2),
            "shards": len(src.shards) + len(dst.shards),
            "items": len(plan.items),
            "gb_moved": round(plan.bytes_moved / 1e9, 1),
        }
        out["cases"][name] = case  # type: ignore[index]
        print(name, case, file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
