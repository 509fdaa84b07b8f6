"""Exactly-once sample accounting: every sample from issue to the trainer, once.

The controller tells the :class:`Manifest` each event of a sample's life, by id:
``issue`` (the source handed it to a step) → ``dispatch`` (a generation attempt starts) →
``abort`` (a migration or preemption stopped the attempt; its partial output will be
re-dispatched) → ... → ``generated`` (the final output) → ``scored`` → ``trained`` (in
the step's update order) → ``close_step``. Nothing raises on a broken rule: each one
becomes a :class:`Violation` in the report, so a run shows every sample lost or
duplicated, and why.

The RLinf #303 class of bug (a resumed sequence already at its length limit returned
twice) is caught twice over: re-dispatching a partial that already reached the sample's
``max_tokens`` is ``redispatch_at_limit``, and a second final output is
``duplicate_generation`` (a late output of an aborted attempt is ``stale_generation``).

Closed steps yield a :class:`StepManifest` (ids in update order, and digests) that is
comparable across runs and policies; after a restore, :meth:`Manifest.rewind` forgets the
steps to redo and each redone step must reproduce its first digest (``replay_diverged``).
Memory is bounded: ids are kept for the open steps and the last ``history_steps`` closed
ones, digests for every closed step unless ``num_digests_kept`` bounds them. Runs on the
controller's loop; every call is cheap and synchronous.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Manifest", "ManifestConfig", "ManifestReport", "StepManifest", "Violation"]

logger = logging.getLogger(__name__)

LOSS_KINDS = frozenset({"lost"})
DUPLICATE_KINDS = frozenset(
    {
        "duplicate_issue",
        "duplicate_dispatch",
        "dispatch_after_generation",
        "redispatch_at_limit",
        "duplicate_generation",
        "stale_generation",
        "duplicate_score",
        "duplicate_training",
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestConfig:
    """Which rules the accounting enforces."""

    require_scoring: bool = True
    """Whether a sample must be scored before it is trained."""
    same_step: bool = True
    """Whether a sample must be trained in the step it was issued for (on-policy RL)."""
    history_steps: int = 4
    """Closed steps whose ids are kept to recognise late duplicates (without
    ``same_step``, samples not trained by then are lost)."""

    num_digests_kept: int | None = None
    """Closed steps whose digest :meth:`Manifest.report` lists (None: every one, about
    150 bytes a step; the journal keeps every digest on disk)."""

    def __post_init__(self) -> None:
        if self.history_steps < 0:
            raise ValueError(f"history_steps must be >= 0, got {self.history_steps}")
        if self.num_digests_kept is not None and self.num_digests_kept < 1:
            raise ValueError(f"num_digests_kept must be >= 1, got {self.num_digests_kept}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Violation:
    """One broken rule."""

    kind: str
    """``lost``, ``duplicate_*``, ``stale_generation``, ``redispatch_at_limit``,
    ``dispatch_after_generation``, ``unknown_sample``, ``unknown_attempt``,
    ``out_of_order``, ``over_limit``, ``wrong_step`` or ``replay_diverged``."""
    sample_id: str
    """The sample (empty for a step-level violation)."""
    step: int
    """Step it belongs to (-1 if unknown)."""
    detail: str = ""
    """What happened."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepManifest:
    """The samples one training step consumed, in update order."""

    step: int
    """Step index."""
    sample_ids: tuple[str, ...]
    """Sample ids in the order the trainer consumed them."""
    digest: str
    """SHA-256 over the step and the ids in order: equal iff membership and order are."""
    membership: str
    """SHA-256 over the step and the sorted ids: equal iff membership is."""
    num_aborted: int
    """Generation attempts of these samples that were aborted (partial outputs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestReport:
    """What the accounting found so far."""

    digests: tuple[tuple[int, str], ...]
    """``(step, digest)`` of every closed step, in closing order."""
    violations: tuple[Violation, ...]
    """Every broken rule, in order."""

    @property
    def lost(self) -> tuple[str, ...]:
        """Ids issued but never trained (once their step closed)."""
        return tuple(sorted({v.sample_id for v in self.violations if v.kind in LOSS_KINDS}))

    @property
    def duplicated(self) -> tuple[str, ...]:
        """Ids issued, generated, scored or trained more than once."""
        kinds = DUPLICATE_KINDS
        return tuple(sorted({v.sample_id for v in self.violations if v.kind in kinds}))

    @property
    def ok(self) -> bool:
        """Whether no rule was broken."""
        return not self.violations


def step_digests(step: int, sample_ids: Iterable[str]) -> tuple[str, str]:
    """(ordered digest, membership digest) of ``sample_ids`` in ``step``."""
    ids = list(sample_ids)

    def digest(parts: list[str]) -> str:
        return hashlib.sha256("\n".join([str(step), *parts]).encode()).hexdigest()

    return digest(ids), digest(sorted(ids))


@dataclass(slots=True)
class _Sample:
    step: int
    max_tokens: int | None
    attempts: int = 0
    running: int | None = None
    partial_tokens: int = 0
    num_aborted: int = 0
    generated: bool = False
    scored: bool = False
    trained_in: int | None = None


@dataclass(slots=True)
class _Step:
    issued: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)


class Manifest:
    """The accounting of one job (see the module docstring)."""

    def __init__(self, config: ManifestConfig | None = None) -> None:
        self.config = config or ManifestConfig()
        self._samples: dict[str, _Sample] = {}
        self._steps: dict[int, _Step] = {}
        self._closed: list[tuple[int, list[str]]] = []
        self._digests: dict[int, str] = {}
        self._expected: dict[int, str] = {}
        self._violations: list[Violation] = []

    def _flag(self, kind: str, sample_id: str, step: int, detail: str = "") -> None:
        violation = Violation(kind=kind, sample_id=sample_id, step=step, detail=detail)
        logger.warning("sample manifest: %s %r at step %d: %s", kind, sample_id, step, detail)
        self._violations.append(violation)

    def _known(self, sample_id: str, event: str) -> _Sample | None:
        sample = self._samples.get(sample_id)
        if sample is None:
            self._flag("unknown_sample", sample_id, -1, f"{event} of a sample never issued")
        return sample

    # ------------------------------------------------------------------ events

    def issue(self, sample_id: str, step: int, *, max_tokens: int | None = None) -> None:
        """The source issued ``sample_id`` for ``step``; ``max_tokens`` is its length limit."""
        if sample_id in self._samples:
            self._flag("duplicate_issue", sample_id, step, "issued twice")
            return
        self._samples[sample_id] = _Sample(step=step, max_tokens=max_tokens)
        self._steps.setdefault(step, _Step()).issued.append(sample_id)

    def dispatch(self, sample_id: str) -> int:
        """A generation attempt of ``sample_id`` starts; returns its attempt number (from 1)."""
        sample = self._known(sample_id, "dispatch")
        if sample is None:
            return 0
        if sample.generated:
            self._flag("dispatch_after_generation", sample_id, sample.step, "already generated")
        elif sample.running is not None:
            detail = f"attempt {sample.running} still running"
            self._flag("duplicate_dispatch", sample_id, sample.step, detail)
        elif sample.num_aborted and _at_limit(sample, sample.partial_tokens):
            detail = f"partial of {sample.partial_tokens} tokens is at its limit"
            self._flag("redispatch_at_limit", sample_id, sample.step, detail)
        sample.attempts += 1
        sample.running = sample.attempts
        return sample.attempts

    def abort(self, sample_id: str, attempt: int, *, num_tokens: int) -> None:
        """Attempt ``attempt`` was aborted with a partial output of ``num_tokens`` tokens."""
        sample = self._known(sample_id, "abort")
        if sample is None:
            return
        if attempt != sample.running:
            detail = f"abort of attempt {attempt}, running {sample.running}"
            self._flag("unknown_attempt", sample_id, sample.step, detail)
            return
        sample.running = None
        sample.num_aborted += 1
        sample.partial_tokens = num_tokens

    def generated(self, sample_id: str, attempt: int, *, num_tokens: int) -> None:
        """Attempt ``attempt`` produced the final output (``num_tokens`` response tokens)."""
        sample = self._known(sample_id, "generation")
        if sample is None:
            return
        if sample.generated:
            self._flag("duplicate_generation", sample_id, sample.step, f"again by {attempt}")
            return
        if attempt != sample.running:
            detail = f"output of attempt {attempt}; running {sample.running}"
            self._flag("stale_generation", sample_id, sample.step, detail)
            return
        if sample.max_tokens is not None and num_tokens > sample.max_tokens:
            detail = f"{num_tokens} tokens over the limit {sample.max_tokens}"
            self._flag("over_limit", sample_id, sample.step, detail)
        sample.running = None
        sample.generated = True

    def scored(self, sample_id: str) -> None:
        """The sample's reward is known."""
        sample = self._known(sample_id, "score")
        if sample is None:
            return
        if not sample.generated:
            self._flag("out_of_order", sample_id, sample.step, "scored before generated")
        elif sample.scored:
            self._flag("duplicate_score", sample_id, sample.step, "scored twice")
        sample.scored = True

    def trained(self, step: int, sample_ids: Iterable[str]) -> None:
        """The trainer consumed ``sample_ids``, in this order, in step ``step``."""
        order = self._steps.setdefault(step, _Step()).order
        for sample_id in sample_ids:
            sample = self._known(sample_id, "training")
            if sample is None:
                continue
            if sample.trained_in is not None:
                detail = f"already trained in step {sample.trained_in}"
                self._flag("duplicate_training", sample_id, step, detail)
                continue
            if not sample.generated:
                self._flag("out_of_order", sample_id, step, "trained before generated")
            elif self.config.require_scoring and not sample.scored:
                self._flag("out_of_order", sample_id, step, "trained before scored")
            if self.config.same_step and sample.step != step:
                self._flag("wrong_step", sample_id, step, f"issued for step {sample.step}")
            sample.trained_in = step
            order.append(sample_id)

    # ------------------------------------------------------------------ steps

    def close_step(self, step: int) -> StepManifest:
        """Close ``step``: its untrained samples are lost (with ``same_step``); returns its
        manifest. A redone step (after :meth:`rewind` or :meth:`expect`) must reproduce its
        first digest, else ``replay_diverged``."""
        record = self._steps.pop(step, _Step())
        if self.config.same_step:
            for sample_id in record.issued:
                if self._samples[sample_id].trained_in is None:
                    self._flag("lost", sample_id, step, "issued but not trained")
        digest, membership = step_digests(step, record.order)
        expected = self._expected.pop(step, None)
        if expected is not None and expected != digest:
            self._flag("replay_diverged", "", step, f"digest {digest[:12]} != {expected[:12]}")
        num_aborted = sum(
            sample.num_aborted for s in record.order if (sample := self._samples.get(s))
        )
        self._digests[step] = digest
        limit = self.config.num_digests_kept
        while limit is not None and len(self._digests) > limit:
            del self._digests[next(iter(self._digests))]
        self._closed.append((step, record.issued))
        self._forget_old()
        return StepManifest(
            step=step,
            sample_ids=tuple(record.order),
            digest=digest,
            membership=membership,
            num_aborted=num_aborted,
        )

    def _forget_old(self) -> None:
        while len(self._closed) > self.config.history_steps:
            step, issued = self._closed.pop(0)
            for sample_id in issued:
                sample = self._samples.pop(sample_id, None)
                if not self.config.same_step and sample and sample.trained_in is None:
                    self._flag("lost", sample_id, step, "not trained within the history")

    def expect(self, step: int, digest: str) -> None:
        """Step ``step`` is being redone and must reproduce ``digest`` (from the journal)."""
        self._expected[step] = digest

    def rewind(self, steps_done: int) -> None:
        """Forget every step from ``steps_done`` on (restored from a checkpoint: they will
        be issued again); their closed digests become expectations."""
        for step, digest in list(self._digests.items()):
            if step >= steps_done:
                self._expected[step] = digest
                del self._digests[step]
        gone = [s for s in self._steps if s >= steps_done]
        gone_ids = [i for s in gone for i in self._steps.pop(s).issued]
        gone_ids += [i for step, issued in self._closed if step >= steps_done for i in issued]
        self._closed = [c for c in self._closed if c[0] < steps_done]
        for sample_id in gone_ids:
            self._samples.pop(sample_id, None)
        logger.info("sample manifest rewound to %d steps done", steps_done)

    def report(self) -> ManifestReport:
        """Digests of the closed steps and every violation so far."""
        return ManifestReport(
            digests=tuple(sorted(self._digests.items())), violations=tuple(self._violations)
        )

    @property
    def open_steps(self) -> tuple[int, ...]:
        """Steps with issued or trained samples that are not closed yet."""
        return tuple(sorted(self._steps))


def _at_limit(sample: _Sample, num_tokens: int) -> bool:
    return sample.max_tokens is not None and num_tokens >= sample.max_tokens
