"""The sample manifest: clean runs, each violation it must catch, digests, rewinds."""

from __future__ import annotations

from collections.abc import Sequence

from dynarl.runtime.durable._manifest import Manifest, ManifestConfig, step_digests


def run_step(manifest: Manifest, step: int, ids: Sequence[str], order: Sequence[str]) -> str:
    """Issue, generate (completing in ``ids`` order), score and train in ``order``."""
    for sample_id in ids:
        manifest.issue(sample_id, step, max_tokens=8)
    for sample_id in ids:
        attempt = manifest.dispatch(sample_id)
        manifest.generated(sample_id, attempt, num_tokens=4)
        manifest.scored(sample_id)
    manifest.trained(step, order)
    return manifest.close_step(step).digest


def test_a_clean_run_has_no_violations_and_digests_follow_update_order() -> None:
    ids = ["a", "b", "c"]
    first, second, third = Manifest(), Manifest(), Manifest()
    digest = run_step(first, 0, ids, ids)
    # Completion order differs (a dynamic run), update order is the same: same digest.
    assert run_step(second, 0, list(reversed(ids)), ids) == digest
    assert run_step(third, 0, ids, ["b", "a", "c"]) != digest
    assert first.report().ok and second.report().ok and third.report().ok
    assert step_digests(0, ids)[1] == step_digests(0, ["c", "b", "a"])[1]
    assert first.report().digests == ((0, digest),)


def test_aborted_and_redispatched_generations_count_once() -> None:
    manifest = Manifest()
    manifest.issue("a", 0, max_tokens=8)
    first = manifest.dispatch("a")
    manifest.abort("a", first, num_tokens=3)
    second = manifest.dispatch("a")
    manifest.abort("a", second, num_tokens=5)
    third = manifest.dispatch("a")
    manifest.generated("a", third, num_tokens=8)
    manifest.scored("a")
    manifest.trained(0, ["a"])
    closed = manifest.close_step(0)
    assert (first, second, third) == (1, 2, 3)
    assert closed.num_aborted == 2 and closed.sample_ids == ("a",)
    assert manifest.report().ok


def test_lost_and_duplicated_samples_are_reported() -> None:
    manifest = Manifest()
    for sample_id in ("a", "b", "c"):
        manifest.issue(sample_id, 0)
        manifest.generated(sample_id, manifest.dispatch(sample_id), num_tokens=1)
        manifest.scored(sample_id)
    manifest.trained(0, ["a", "b", "b"])
    manifest.scored("a")
    manifest.close_step(0)
    report = manifest.report()
    assert report.lost == ("c",)
    assert report.duplicated == ("a", "b")
    kinds = {(v.kind, v.sample_id) for v in report.violations}
    assert kinds == {("lost", "c"), ("duplicate_training", "b"), ("duplicate_score", "a")}


def test_the_rlinf_303_bug_class_is_caught() -> None:
    """A partial already at its length limit is re-dispatched and returned twice."""
    manifest = Manifest()
    manifest.issue("s", 0, max_tokens=4)
    first = manifest.dispatch("s")
    manifest.abort("s", first, num_tokens=4)  # the migration aborted it at the limit...
    manifest.generated("s", first, num_tokens=4)  # ...and the engine also returned it
    second = manifest.dispatch("s")  # the resumed copy, with nothing left to generate
    manifest.generated("s", second, num_tokens=4)
    report = manifest.report()
    assert [v.kind for v in report.violations] == ["stale_generation", "redispatch_at_limit"]
    assert report.duplicated == ("s",)


def test_a_second_final_output_is_a_duplicate_generation() -> None:
    manifest = Manifest()
    manifest.issue("s", 0, max_tokens=4)
    attempt = manifest.dispatch("s")
    manifest.generated("s", attempt, num_tokens=4)
    manifest.generated("s", attempt, num_tokens=4)
    manifest.dispatch("s")
    kinds = [v.kind for v in manifest.report().violations]
    assert kinds == ["duplicate_generation", "dispatch_after_generation"]


def test_order_and_membership_rules() -> None:
    manifest = Manifest()
    manifest.issue("a", 0, max_tokens=2)
    manifest.trained(0, ["a", "ghost"])  # not generated; never issued
    manifest.issue("b", 1)
    manifest.generated("b", manifest.dispatch("b"), num_tokens=1)
    manifest.trained(0, ["b"])  # not scored; issued for step 1
    manifest.issue("b", 1)
    kinds = [(v.kind, v.sample_id) for v in manifest.report().violations]
    assert kinds == [
        ("out_of_order", "a"),
        ("unknown_sample", "ghost"),
        ("out_of_order", "b"),
        ("wrong_step", "b"),
        ("duplicate_issue", "b"),
    ]
    relaxed = Manifest(ManifestConfig(require_scoring=False, same_step=False))
    relaxed.issue("b", 1)
    relaxed.generated("b", relaxed.dispatch("b"), num_tokens=1)
    relaxed.trained(0, ["b"])
    assert relaxed.report().ok


def test_rewind_then_redo_must_reproduce_the_digests() -> None:
    manifest = Manifest()
    ids = [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]]
    digests = [run_step(manifest, step, ids[step], ids[step]) for step in range(3)]
    manifest.rewind(1)  # restored the checkpoint taken after step 0
    assert manifest.report().digests == ((0, digests[0]),)
    assert run_step(manifest, 1, ids[1], ids[1]) == digests[1]
    assert manifest.report().ok  # the same ids again: not duplicates, a replay
    run_step(manifest, 2, ids[2], list(reversed(ids[2])))
    [violation] = manifest.report().violations
    assert violation.kind == "replay_diverged" and violation.step == 2


def test_expectations_from_the_journal_are_checked() -> None:
    manifest = Manifest()
    manifest.expect(5, step_digests(5, ["x", "y"])[0])
    run_step(manifest, 5, ["x", "y"], ["x", "y"])
    manifest.expect(6, "0" * 64)
    run_step(manifest, 6, ["z"], ["z"])
    assert [v.kind for v in manifest.report().violations] == ["replay_diverged"]


def test_memory_is_bounded_by_the_history() -> None:
    manifest = Manifest(ManifestConfig(history_steps=2))
    for step in range(50):
        ids = [f"{step}-{i}" for i in range(4)]
        run_step(manifest, step, ids, ids)
    assert len(manifest._samples) == 2 * 4 and manifest.open_steps == ()
    manifest.trained(49, ["49-0"])  # recent: recognised as a duplicate
    manifest.trained(49, ["10-0"])  # forgotten: still flagged, as unknown
    kinds = [v.kind for v in manifest.report().violations]
    assert kinds == ["duplicate_training", "unknown_sample"]


def test_digests_kept_can_be_bounded() -> None:
    manifest = Manifest(ManifestConfig(num_digests_kept=3))
    for step in range(10):
        run_step(manifest, step, [f"{step}"], [f"{step}"])
    assert [step for step, _ in manifest.report().digests] == [7, 8, 9]


def test_without_same_step_untrained_samples_are_lost_when_they_leave_the_history() -> None:
    manifest = Manifest(ManifestConfig(same_step=False, history_steps=1))
    manifest.issue("late", 0)
    manifest.close_step(0)
    assert manifest.report().ok
    manifest.close_step(1)
    assert manifest.report().lost == ("late",)
