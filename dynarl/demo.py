"""``dynarl demo``: a controller, group managers and workers on the real bus, live.

The controller (this process) hosts the bus server and the ``samples`` channel. It starts
one manager process per component and one worker process per core: rollout workers run a
small torch policy that samples token sequences and put them into the channel (blocking
when it is full), trainer workers take batches and run policy-gradient steps on them.
Each worker reports ``WorkerMetrics`` to its group manager once per interval; each manager
sends the controller one aggregated ``ComponentReport`` per interval, whatever its number
of workers. The controller shows live figures — per-worker utilization, samples/s, bus
requests/s, reports/s and round-trip times — then a summary, and stops every process it
started. Until the reference RL job exists this is the most real thing dynarl runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dynarl.bus import (
    Ack,
    BusClient,
    BusConfig,
    BusServer,
    Channel,
    ChannelBackend,
    ComponentReport,
    Peer,
    Ping,
    Sample,
    WorkerGroup,
    WorkerMetrics,
    pack_tokens,
    run,
    unpack_tokens,
)
from dynarl.types import ComponentKind

__all__ = ["SUMMARY", "ToyRollout", "ToyTrainer", "add_arguments", "main"]

SUMMARY = "run a live multi-process demo of the bus: rollout and trainer workers on this machine"
CONFIG = BusConfig(heartbeat_interval_s=0.5, num_missed_heartbeats=4, default_timeout_s=30.0)
VOCAB, HIDDEN, PROMPT, NEW_TOKENS, BATCH = 512, 128, 8, 24, 16


def _policy(seed: int) -> object:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, VOCAB),
    )  # fmt: skip


class ToyRollout(WorkerGroup, kind=ComponentKind.ROLLOUT, min_workers=1):
    """Samples token sequences from a small policy; reward = share of tokens below VOCAB/2."""

    samples = Channel("samples", Sample, capacity=64)

    def __init__(self, worker: int, backend: ChannelBackend) -> None:
        self.worker, self.busy_s, self.completed = worker, 0.0, 0
        self.samples = type(self).samples.bind(backend)
        self._policy = _policy(1234)

    def _generate(self, batch: int) -> list[Sample]:
        import torch

        with torch.no_grad():
            tokens = torch.randint(0, VOCAB, (BATCH, PROMPT))
            for _ in range(NEW_TOKENS):
                logits = self._policy(tokens[:, -1])  # type: ignore[operator]
                tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        rewards = (tokens[:, PROMPT:] < VOCAB // 2).float().mean(dim=1)
        return [
            Sample(
                sample_id=f"r{self.worker}-b{batch}-{row}",
                token_ids=pack_tokens(tokens[row].numpy()),
                prompt_len=PROMPT,
                reward=float(rewards[row]),
            )
            for row in range(BATCH)
        ]

    async def run(self) -> None:
        """Generate batches forever, blocking on the channel when the trainer lags."""
        for batch in range(sys.maxsize):
            start = time.perf_counter()
            generated = await asyncio.to_thread(self._generate, batch)
            self.busy_s += time.perf_counter() - start
            for sample in generated:
                await self.samples.put(sample, key="train")
            self.completed += len(generated)


class ToyTrainer(WorkerGroup, kind=ComponentKind.TRAINER, min_workers=1):
    """REINFORCE steps on batches of samples taken from the channel."""

    samples = Channel("samples", Sample, capacity=64)

    def __init__(self, worker: int, backend: ChannelBackend) -> None:
        import torch

        self.worker, self.busy_s, self.completed = worker, 0.0, 0
        self.samples = type(self).samples.bind(backend)
        self._policy = _policy(1234)
        self._optimizer = torch.optim.SGD(self._policy.parameters(), lr=0.05)  # type: ignore[attr-defined]

    def _step(self, batch: list[Sample]) -> float:
        import torch

        tokens = torch.stack([torch.from_numpy(unpack_tokens(s.token_ids).copy()) for s in batch])
        rewards = torch.tensor([s.reward or 0.0 for s in batch])
        logits = self._policy(tokens[:, PROMPT - 1 : -1])  # type: ignore[operator]
        chosen = logits.log_softmax(-1).gather(-1, tokens[:, PROMPT:, None]).squeeze(-1)
        loss = -((rewards - rewards.mean())[:, None] * chosen).mean()
        self._optimizer.zero_grad()
        loss.backward()
        self._optimizer.step()
        return float(loss.detach())

    async def run(self) -> None:
        """Train on batches as they arrive."""
        while True:
            batch = [await self.samples.get(key="train") for _ in range(BATCH)]
            start = time.perf_counter()
            await asyncio.to_thread(self._step, batch)
            self.busy_s += time.perf_counter() - start
            self.completed += len(batch)


GROUPS: dict[str, type[ToyRollout] | type[ToyTrainer]] = {
    "rollout": ToyRollout,
    "trainer": ToyTrainer,
}


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


async def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    name = f"{args.group}/{args.index}"
    async with (
        BusClient(args.controller, name=f"{name}/data", config=CONFIG) as data,
        BusClient(
            args.manager, name=name, config=CONFIG, role="worker", component=args.group
        ) as manager,
    ):
        component = GROUPS[args.group](args.index, data)

        async def report() -> None:
            busy, done, last = 0.0, 0, time.perf_counter()
            while True:
                await asyncio.sleep(args.interval)
                now = time.perf_counter()
                metrics = WorkerMetrics(
                    component=args.group,
                    worker=args.index,
                    time=time.time(),
                    interval_s=now - last,
                    utilization=min(1.0, (component.busy_s - busy) / (now - last)),
                    completed=component.completed - done,
                )
                busy, done, last = component.busy_s, component.completed, now
                await manager.request(metrics)

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(component.run()), group.create_task(report())]
            await _until_stopped()
            for task in tasks:
                task.cancel()


async def _manager(args: argparse.Namespace) -> None:
    latest: dict[int, WorkerMetrics] = {}
    kind = GROUPS[args.group].spec.kind
    total = 0

    def collect(message: WorkerMetrics, peer: Peer) -> Ack:
        latest[message.worker] = message
        return Ack()

    async with BusServer(name=f"{args.group}-manager", config=CONFIG) as server:
        server.route(WorkerMetrics, collect)
        sys.stdout.write(server.address + "\n")
        sys.stdout.flush()
        async with BusClient(
            args.controller, name=f"{args.group}/manager", config=CONFIG, role="manager"
        ) as controller:

            async def forward() -> None:
                nonlocal total
                while True:
                    await asyncio.sleep(args.interval)
                    reports = [latest.get(worker) for worker in range(args.workers)]
                    done = sum(r.completed for r in reports if r is not None)
                    total += done
                    await controller.request(
                        ComponentReport(
                            component=args.group,
                            kind=str(kind),
                            time=time.time(),
                            interval_s=args.interval,
                            throughput=done / args.interval,
                            utilization=tuple(r.utilization if r else 0.0 for r in reports),
                            completed=total,
                        )
                    )

            async with asyncio.TaskGroup() as group:
                task = group.create_task(forward())
                await _until_stopped()
                task.cancel()


@dataclass
class _Figures:
    reports: dict[str, ComponentReport] = field(default_factory=dict)
    num_reports: int = 0
    rtts_us: list[float] = field(default_factory=list)
    samples_per_s: dict[str, list[float]] = field(default_factory=dict)
    utilization: dict[str, list[float]] = field(default_factory=dict)

    def take(self, report: ComponentReport, peer: Peer) -> Ack:
        self.reports[report.component] = report
        self.num_reports += 1
        self.samples_per_s.setdefault(report.component, []).append(report.throughput)
        self.utilization.setdefault(report.component, []).extend(report.utilization)
        return Ack()


def _table(figures: _Figures, server: BusServer, rates: dict[str, float], left: float) -> object:
    from rich.table import Table

    table = Table(title=f"dynarl demo — {left:4.0f} s left", expand=False)
    for column in ("component", "workers", "utilization per worker", "samples/s", "done"):
        table.add_column(column)
    for name, report in sorted(figures.reports.items()):
        bars = "  ".join(f"{'█' * round(u * 10):<10} {u:4.0%}" for u in report.utilization)
        row = [name, str(len(report.utilization)), bars, f"{report.throughput:,.0f}"]
        table.add_row(*row, f"{report.completed:,}")
    queued = sum(server.channels.sizes().values())
    rtt = statistics.median(figures.rtts_us[-50:]) if figures.rtts_us else 0.0
    table.caption = (
        f"bus: {rates['requests']:,.0f} req/s at the controller, {rates['reports']:.1f} reports/s,"
        f" controller→manager RTT p50 {rtt:,.0f} µs, {queued} samples queued,"
        f" {len(server.peers())} peers"
    )
    return table


async def _controller(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console, figures, children = Console(), _Figures(), []
    num_workers = args.workers or len(os.sched_getaffinity(0))
    num_trainers = max(1, num_workers // 4)
    sizes = {"rollout": max(1, num_workers - num_trainers), "trainer": num_trainers}
    me = [sys.executable, "-m", "dynarl.demo"]
    common = ["--interval", str(args.interval)]
    async with BusServer(name="controller", config=CONFIG) as server:
        server.route(ComponentReport, figures.take)
        try:
            for group, count in sizes.items():
                command = [*me, "manager", group, "--controller", server.address]
                command += ["--workers", str(count), *common]
                manager = await asyncio.create_subprocess_exec(
                    *command, stdout=asyncio.subprocess.PIPE
                )
                children.append(manager)
                assert manager.stdout is not None
                address = (await manager.stdout.readline()).decode().strip()
                for index in range(count):
                    worker = [*me, "worker", group, "--index", str(index), "--manager", address]
                    worker += ["--controller", server.address, *common]
                    children.append(await asyncio.create_subprocess_exec(*worker))
            console.print(
                f"[bold]dynarl demo[/]: controller at {server.address}, "
                f"{sizes['rollout']} rollout + {sizes['trainer']} trainer workers, "
                f"{len(children)} processes, {args.duration:.0f} s"
            )
            await _watch(args, server, figures, Live(console=console, refresh_per_second=4))
        finally:
            await _stop(children)
    _summary(console, figures, server, sizes, len(children))
    return 0


async def _watch(
    args: argparse.Namespace, server: BusServer, figures: _Figures, live: object
) -> None:
    from rich.live import Live

    assert isinstance(live, Live)
    start = time.monotonic()
    last = (start, server.stats.requests_in, figures.num_reports)
    rates = {"requests": 0.0, "reports": 0.0}
    printed = start
    with live:
        while (now := time.monotonic()) - start < args.duration:
            for manager in [name for name in server.peers() if name.endswith("/manager")]:
                sent = time.perf_counter()
                await server.request(manager, Ping(seq=len(figures.rtts_us)), timeout=5)
                figures.rtts_us.append((time.perf_counter() - sent) * 1e6)
            if now - last[0] >= 1.0:
                span = now - last[0]
                rates["requests"] = (server.stats.requests_in - last[1]) / span
                rates["reports"] = (figures.num_reports - last[2]) / span
                last = (now, server.stats.requests_in, figures.num_reports)
            table = _table(figures, server, rates, args.duration - (now - start))
            live.update(table)  # type: ignore[arg-type]
            if not live.console.is_terminal and now - printed >= 5.0:
                printed = now  # no live redraw in a log: a status line every few seconds
                live.console.print(f"{now - start:4.0f} s  {table.caption}")  # type: ignore[attr-defined]
            await asyncio.sleep(0.25)


async def _stop(children: Sequence[asyncio.subprocess.Process]) -> None:
    for child in children:
        if child.returncode is None:
            child.terminate()
    for child in children:
        try:
            await asyncio.wait_for(child.wait(), 10)
        except TimeoutError:
            child.kill()
            await child.wait()


def _summary(
    console: object, figures: _Figures, server: BusServer, sizes: dict[str, int], num_processes: int
) -> None:
    from rich.console import Console

    assert isinstance(console, Console)
    console.print("\n[bold]summary[/]")
    for name in sorted(figures.samples_per_s):
        rates, utils = figures.samples_per_s[name], figures.utilization[name]
        done = figures.reports[name].completed
        console.print(
            f"  {name:8s} {sizes[name]} workers  mean {statistics.mean(rates):8,.0f} samples/s  "
            f"mean utilization {statistics.mean(utils):4.0%}  done {done:,}"
        )
    if figures.rtts_us:
        ordered = sorted(figures.rtts_us)
        console.print(
            f"  bus      {server.stats.requests_in:,} requests served by the controller, "
            f"{figures.num_reports} reports; controller→manager RTT p50 "
            f"{ordered[len(ordered) // 2]:,.0f} µs, p99 {ordered[int(len(ordered) * 0.99)]:,.0f} µs"
        )
    console.print(f"  stopped all {num_processes} processes this demo started")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dynarl demo`` options."""
    parser.add_argument("--duration", type=float, default=30.0, help="seconds to run")
    parser.add_argument("--workers", type=int, default=0, help="worker processes (0: one per core)")
    parser.add_argument("--interval", type=float, default=1.0, help="reporting interval, seconds")


def main(args: argparse.Namespace) -> int:
    """Run the demo (the controller); returns the exit status."""
    if args.duration <= 0 or args.interval <= 0 or args.workers < 0:
        raise ValueError("--duration and --interval must be positive, --workers >= 0")
    return run(_controller(args))


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynarl.demo")
    parser.add_argument("role", choices=["manager", "worker"])
    parser.add_argument("group", choices=sorted(GROUPS))
    parser.add_argument("--controller", required=True)
    parser.add_argument("--manager", default="")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    run(_manager(args) if args.role == "manager" else _worker(args))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
