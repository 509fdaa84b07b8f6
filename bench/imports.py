"""Import cost of every public package: seconds to import it, and the heavy modules it loads.

Each package is imported in a fresh interpreter (``import X`` timed with
``time.perf_counter`` inside the child, so interpreter start-up is not counted), three times;
the figure is the median. After the import the child lists which of the heavy third-party
packages (:data:`HEAVY`) are in ``sys.modules``. ``import torch`` alone is timed the same
way as the baseline: ``torch_ratio`` is a package's time over it (about 1 or more: the
package pays for torch). Times are noisy on a shared machine; the heavy lists are
deterministic (``tests/unit/test_import_costs.py`` asserts the layering facts). Last line:
JSON.

Run: .venv/bin/python bench/imports.py [--repeats N] [package ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PACKAGES = (
    "dynarl",
    "dynarl.bus",
    "dynarl.sched",
    "dynarl.migrate",
    "dynarl.sim",
    "dynarl.sim.policies",
    "dynarl.runtime",
    "dynarl.runtime.controller",
    "dynarl.runtime.worker",
    "dynarl.runtime.launch",
    "dynarl.runtime.durable",
    "dynarl.backends",
    "dynarl.backends.reference",
    "dynarl.backends.sglang",
    "dynarl.backends.megatron",
    "dynarl.demo",
    "dynarl.testing",
    "dynarl.testing.sglang_fake",
    "dynarl.plots",
    "dynarl.cli",
)
HEAVY = (
    "torch",
    "numpy",
    "matplotlib",
    "megatron",
    "aiohttp",
    "vllm",
    "sglang",
    "rich",
    "zmq",
    "prometheus_client",
)

# Run in the child: time the import, then list the heavy top-level packages it loaded.
CHILD = """
import json, sys, time
start = time.perf_counter()
import {package}
seconds = time.perf_counter() - start
loaded = {{name.partition(".")[0] for name in sys.modules}}
print(json.dumps({{"s": seconds, "heavy": [h for h in {heavy!r} if h in loaded]}}))
"""


def import_once(package: str) -> tuple[float, list[str]]:
    """Seconds to import ``package`` in a fresh interpreter, and the heavy modules loaded.

    Raises RuntimeError with the child's last line of stderr when the import fails.
    """
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(package=package, heavy=HEAVY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise RuntimeError(lines[-1])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["s"]), list(result["heavy"])


def measure(package: str, repeats: int) -> dict[str, object]:
    """The median import time of ``package`` over ``repeats`` fresh interpreters."""
    try:
        runs = [import_once(package) for _ in range(repeats)]
    except RuntimeError as exc:
        return {"import_s": None, "heavy": [], "error": str(exc)}
    return {
        "import_s": round(statistics.median(s for s, _ in runs), 3),
        "heavy": runs[-1][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=PACKAGES, help="packages to import")
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per package")
    args = parser.parse_args()
    torch_s = measure("torch", args.repeats)["import_s"]
    print(f"baseline: import torch {torch_s} s (median of {args.repeats})", flush=True)
    print(f"{'package':28s} {'import s':>9s} {'/torch':>7s}  heavy modules loaded")
    results: dict[str, dict[str, object]] = {}
    for package in args.packages:
        row = results[package] = measure(package, args.repeats)
        seconds = row["import_s"]
        if isinstance(seconds, float) and isinstance(torch_s, float) and torch_s > 0:
            row["torch_ratio"] = round(seconds / torch_s, 3)
        shown = f"{seconds:9.3f}" if isinstance(seconds, float) else f"{'failed':>9s}"
        ratio = row.get("torch_ratio")
        ratio_shown = f"{ratio:7.2f}" if isinstance(ratio, float) else f"{'-':>7s}"
        heavy = row["heavy"]
        heavy = ", ".join(heavy) if isinstance(heavy, list) and heavy else "-"
        print(f"{package:28s} {shown} {ratio_shown}  {row.get('error', heavy)}", flush=True)
    print(json.dumps({"torch_s": torch_s, "repeats": args.repeats, "packages": results}))


if __name__ == "__main__":
    main()
