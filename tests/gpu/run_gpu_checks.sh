#!/usr/bin/env bash
# dynarl's GPU checks in one script, for a machine with one GPU; a few minutes.
#
# 1. Every `gpu`-marked test (tests/gpu): Megatron GPTModel forward/backward on CUDA with the
#    CPU shim NOT applied; MegatronTrainer on CUDA with Megatron's own optimizers (FP32, bf16
#    with fp32 master weights, the distributed optimizer, its flat ranges cross-checked
#    against the layout); NCCL groups built over a PrefixStore; a P2P reshard of CUDA state
#    through the executor (NCCL migration group, CUDA checksums); the weight sync from a CUDA
#    trainer to a fake SGLang engine; the reshard executor's CUDA checksum; SGLang's Triton
#    tensor hash against dynarl's CPU re-implementation (when the sglang 0.5.23 wheel is
#    cached in $DYNARL_SGLANG_WHEEL_DIR); test_megatron_role_gpu.py: the Megatron trainer
#    role on CUDA in a real Job, grown from one device to two by a P2P reshard over NCCL and
#    shrunk back (state checksums kept; two GPUs, one per worker), and push_to_engines from
#    a CUDA trainer to the fake SGLang server (its version and checksums checked), over gloo
#    (one GPU) and over NCCL (the fake receiving on the second GPU).
#    test_megatron_cp_gpu.py, test_megatron_vpp_gpu.py: context parallelism and the interleaved pipeline, which
#    MegatronTrainer does not train (models built with Megatron's APIs on dynarl's layout
#    groups): CP 2 (bf16, distributed optimizer over dp x cp; needs Transformer Engine)
#    against CP 1, its layout against sharded_state_dict() and the optimizer's ranges, a P2P
#    reshard to CP 1 kept bitwise; PP 2 x VPP 2 with the interleaved schedule against PP 1,
#    each chunk's parameters against pipeline_chunks. One GPU: Megatron's schedule against
#    MegatronTrainer, and the TE-attention model against it (TE needed).
# 2. The GPU benchmarks a host of this size can run: `bench/megatron_sync.py --device cuda`.
#
# Several NCCL ranks cannot share one GPU, so everything with two NCCL ranks
# (test_migrate_nccl.py, the two-rank test in test_megatron_gpu.py, the role's reshard and
# the NCCL push in test_megatron_role_gpu.py, the CP 2 and PP 2 x VPP 2 tests in
# test_megatron_cp_gpu.py, test_megatron_vpp_gpu.py, the benchmark above) needs a host with two or more GPUs and
# reports "skipped" with that reason here. Tests that need Transformer Engine (context
# parallelism) report "skipped" with the import error where it does not import;
# gpu-env.json says whether it did (optional_modules). bench/reshard.py is a four-rank
# gloo (CPU) benchmark with no NCCL mode; it is not run here.
#
# Results under $OUT (default ./gpu-results): gpu-pytest.log, gpu-junit.xml,
# bench-megatron-sync.json and gpu-summary.json (environment, per-test outcomes, benchmark).
# Exit status: pytest's (2 when no CUDA device is visible; DYNARL_GPU_DRY_RUN=1 runs anyway, to
# check the script itself on a CPU machine: every test then reports "skipped: needs CUDA").
#
# Python: $PYTHON, else .venv/bin/python when its torch sees CUDA, else python3. The tests
# need megatron-core, msgspec, pyzmq, aiohttp, safetensors, psutil, hypothesis and pytest
# (+ pytest-timeout); missing ones may be given as wheels in $DYNARL_WHEELS (default .whl),
# installed for this run only into a private directory.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi

WHEELS="${DYNARL_WHEELS:-$ROOT/.whl}"
SITE=""
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="$(mktemp -d /tmp/dynarl-site.XXXXXX)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    || echo "warning: installing the wheels in $WHEELS failed" >&2
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - "$OUT/gpu-env.json" <<'EOF'
import importlib, json, sys
env = {"python": sys.version.split()[0]}
try:
    import torch
    env.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
               devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception as exc:  # the summary says why nothing ran
    env.update(torch=None, cuda=False, devices=[], error=repr(exc))
missing = []
for name in ("megatron.core", "msgspec", "zmq", "aiohttp", "safetensors", "psutil", "hypothesis", "pytest", "pytest_timeout"):
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
env["missing_modules"] = missing
optional = {}
for name in ("transformer_engine",):  # context parallelism (test_megatron_cp_gpu.py)
    try:
        module = importlib.import_module(name)
        optional[name] = str(getattr(module, "__version__", "present"))
    except Exception as exc:
        optional[name] = f"missing: {exc!r}"[:200]
env["optional_modules"] = optional
json.dump(env, open(sys.argv[1], "w"), indent=1)
print("environment:", json.dumps(env))
EOF

if [ -z "${DYNARL_GPU_DRY_RUN:-}" ] && ! "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "no CUDA device visible to $PY: nothing to check" >&2
  "$PY" -c 'import json,sys; e=json.load(open(sys.argv[1])); json.dump({"status": "no-cuda", "environment": e}, open(sys.argv[2], "w"), indent=1)' \
    "$OUT/gpu-env.json" "$OUT/gpu-summary.json"
  exit 2
fi

set -o pipefail
timeout 1200 "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -rA --durations=10 \
  --junitxml="$OUT/gpu-junit.xml" 2>&1 | tee "$OUT/gpu-pytest.log"
TESTS_RC=$?

timeout 900 "$PY" bench/megatron_sync.py --device cuda --reps 3 2>"$OUT/bench-megatron-sync.err" \
  | tail -n 1 >"$OUT/bench-megatron-sync.json"
echo "bench/megatron_sync.py --device cuda: $(cat "$OUT/bench-megatron-sync.json")"

"$PY" - "$OUT" "$TESTS_RC" <<'EOF'
import json, pathlib, sys
import xml.etree.ElementTree as ET
out, rc = pathlib.Path(sys.argv[1]), int(sys.argv[2])
tests = {}
junit = out / "gpu-junit.xml"
if junit.exists():
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = f"{tag}: {(node.get('message') or '')[:200]}"
        tests[name] = outcome
try:
    bench = json.loads((out / "bench-megatron-sync.json").read_text() or "null")
except ValueError:
    bench = {"error": (out / "bench-megatron-sync.err").read_text()[-2000:]}
counts = {k: sum(v.startswith(k) for v in tests.values()) for k in ("passed", "failure", "error", "skipped")}
summary = {"status": "ok" if rc == 0 else f"pytest exit {rc}", "counts": counts, "tests": tests,
           "bench_megatron_sync": bench, "environment": json.loads((out / "gpu-env.json").read_text())}
(out / "gpu-summary.json").write_text(json.dumps(summary, indent=1))
print("summary:", json.dumps({"status": summary["status"], "counts": counts}))
EOF
rm -f "$OUT/bench-megatron-sync.err"
exit "$TESTS_RC"
