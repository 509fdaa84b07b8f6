#!/usr/bin/env bash
# Two "nodes" on this machine, each its own torchrun, launching a dynarl job over CURVE.
#
# What a real two-node launch does, on loopback: each node gets a CURVE key pair
# (`dynarl keys`, run outside the job), every node trusts the public keys in one
# allow-list directory, and each node runs one torchrun command, the same on every node
# but for --key-file, which names that node's own secret key (c10d rendezvous; node 0
# hosts it). The job is the job file examples/torchrun_job.py (a reference GRPO job: a
# rollout engine on device 0, a trainer on device 1): rank 0 runs its controller and its
# loop, every rank a worker; the bus is authenticated and encrypted (--curve; always on
# for a routable --bind-host). On real machines: --rdzv-endpoint HOST0:PORT, --bind-host
# 0.0.0.0, the key files provisioned on each node, and a --job-dir every node shares. See
# docs/torchrun.md.
#
# Usage: examples/torchrun_two_node.sh [NUM_STEPS]   (from the repository root; about 20 s)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-$HERE/../.venv/bin/python}"
STEPS="${1:-2}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dynarl-two-node.XXXXXX")"
PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || true  # each torchrun leads its own group
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

# 1. Keys: one pair per node; the allow-list holds the public halves.
mkdir -p "$WORK/keys" "$WORK/authorized" "$WORK/job"
for node in 0 1; do
    "$PY" -m dynarl.cli keys "node$node" --dir "$WORK/keys" >/dev/null
    cp "$WORK/keys/node$node.key" "$WORK/authorized/"
done

# 2. The rendezvous port (on real machines: a fixed port on node 0).
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

# 3. One torchrun per node, in its own process group.
for node in 0 1; do
    OMP_NUM_THREADS=1 PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" setsid "$PY" -m torch.distributed.run \
        --nnodes 2 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id dynarl-two-node \
        --rdzv-conf "is_host=$((node == 0))" \
        -m dynarl.runtime.launch --job torchrun_job:job --job-dir "$WORK/job" \
        --curve --key-file "$WORK/keys/node$node.key_secret" --allowed-keys "$WORK/authorized" \
        --rendezvous-timeout 120 --log-level WARNING \
        -- --steps "$STEPS" >"$WORK/node$node.log" 2>&1 &
    PIDS+=("$!")
done

status=0
for node in 0 1; do
    if ! wait "${PIDS[$node]}"; then
        status=1
        echo "node $node failed; its log:" >&2
        tail -n 40 "$WORK/node$node.log" >&2
    fi
done
PIDS=()
[ "$status" -eq 0 ] || exit "$status"
echo "result: $(cat "$WORK/job/result.json")"
