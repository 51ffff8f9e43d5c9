"""The trainer feed's pure parts: staleness verdicts, the offset ledger that lets the feed commit
past what it drops (and lay trajectories out of order), and the reverse join's outcome index."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.evaluations import Evaluation
from sinks.batching import TrainingSequence, pad_sequences
from sinks.join import OutcomeIndex
from sinks.offsets import OffsetLedger
from sinks.staleness import StalenessPolicy, Verdict, current_version
from tests.sinks import group, trajectory


def test_within_bounds_is_kept_past_them_dropped() -> None:
    policy = StalenessPolicy(max_staleness=1)
    assert policy.judge(oldest=4, current=5) == Verdict(lag=1)
    assert policy.judge(oldest=3, current=5) == Verdict(lag=2, stale=True, weight=0.0, drop=True)
    assert policy.judge(oldest=7, current=5) == Verdict(lag=-2)  # newer than the trainer says: in bounds
    # Unknown versions, or a trainer that has not said its version: current.
    assert policy.judge(oldest=None, current=5) == Verdict(lag=None)
    assert policy.judge(oldest=0, current=None) == Verdict(lag=None)
    # No limit: lag reported, nothing stale.
    assert StalenessPolicy().judge(oldest=0, current=9) == Verdict(lag=9)


def test_downweighting_decays_per_version_past_the_limit() -> None:
    policy = StalenessPolicy(max_staleness=1, action="downweight", decay=0.5)
    assert policy.judge(oldest=4, current=5) == Verdict(lag=1)
    assert policy.judge(oldest=3, current=5) == Verdict(lag=2, stale=True, weight=0.5)
    assert policy.judge(oldest=1, current=5) == Verdict(lag=4, stale=True, weight=0.125)
    assert StalenessPolicy(0, "downweight", decay=1.0).judge(oldest=0, current=3) == Verdict(3, stale=True)


@pytest.mark.parametrize("options, message", [
    ({"max_staleness": -1}, "max_staleness"), ({"action": "discard"}, "stale"), ({"decay": 0.0}, "stale_decay"),
    ({"decay": 1.5}, "stale_decay"),
])
def test_bad_staleness_settings_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StalenessPolicy(**options)


def test_the_trainers_version_is_a_number_or_asked_for() -> None:
    assert current_version(None) is None and current_version(3) == 3 and current_version(lambda: 4) == 4
    with pytest.raises(TypeError):
        current_version(lambda: "5")  # type: ignore[arg-type, return-value]


def test_the_ledger_commits_up_to_the_first_record_not_done() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    for offset in range(5):
        ledger.read("p", offset)
    ledger.done("p", 0)  # passed over (stale, no group)
    assert ledger.positions() == {"p": 1}
    ledger.batched("p", 2, 0)  # out of read order: 1 still waits for its reward
    ledger.batched("p", 3, 0)
    ledger.done("p", 4)
    assert ledger.positions(through=0) == {"p": 1}
    ledger.acknowledged(0)
    assert ledger.positions() == {"p": 1}  # 1 is still open: never committed past
    ledger.batched("p", 1, 1)
    assert ledger.positions(through=1) == {"p": 5}
    ledger.acknowledged(1)
    assert ledger.positions() == {"p": 5} and ledger.open_count() == 0
    ledger.passed("p", 9)  # records the feed never saw (transaction markers): nothing waits on them
    assert ledger.positions() == {"p": 10}
    ledger.forget(["p"])
    assert ledger.positions() == {}


def test_acknowledgements_are_cumulative() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    for partition, offset, batch in (("a", 0, 0), ("b", 0, 1), ("a", 1, 2)):
        ledger.read(partition, offset)
        ledger.batched(partition, offset, batch)
    ledger.acknowledged(1)
    assert ledger.positions() == {"a": 1, "b": 1}


def test_the_outcome_index_prefers_the_named_evaluator_then_the_groups() -> None:
    index = OutcomeIndex(max_sessions=2)
    index.add_evaluation(Evaluation(session_id="s0", evaluator="session_completed", reward=1.0))
    assert index.get("s0") is not None and index.get("s0").reward(None) == (True, 1.0)  # type: ignore[union-attr]
    assert index.get("s0").reward("tests") == (False, None)  # type: ignore[union-attr]
    index.add_evaluation(Evaluation(session_id="s0", evaluator="tests", reward=0.0))
    trajectories = [trajectory("s0", "t"), trajectory("s1", "t")]
    index.add_group(group("t", trajectories, [0.5, None], rewards=[0.0, None]))
    s0, s1 = index.get("s0"), index.get("s1")
    assert s0 is not None and s1 is not None
    assert s0.reward(None) == (True, 0.0) and s0.advantage == 0.5 and s0.group_id == "g-t"
    # The group kept s1 out (no reward will come for it): answered, without a reward.
    assert s1.reward(None) == (True, None) and s1.advantage is None
    index.add_evaluation(Evaluation(session_id="s2", evaluator="tests", status="error", error="docker died"))
    assert index.get("s2").reward("tests") == (True, None)  # type: ignore[union-attr]
    assert len(index) == 2 and index.evicted == 1 and index.get("s0") is None  # least recently updated


def test_weights_scale_advantages_and_an_unknown_advantage_trains_nothing() -> None:
    def sequence(advantage: float | None, weight: float) -> TrainingSequence:
        tokens = np.arange(4, dtype=np.int32)
        return TrainingSequence(tokens, np.array([0, 1, 1, 1], np.uint8), np.full(4, -0.5, np.float32), advantage,
                                "s", "t", "g", "tr", "s/0", weight=weight)

    arrays = pad_sequences([sequence(2.0, 0.25), sequence(None, 1.0)])
    assert arrays.advantages.tolist() == [[0, 0.5, 0.5, 0.5], [0, 0, 0, 0]]
    assert arrays.loss_mask.tolist() == [[0, 1, 1, 1]] * 2  # the mask is the tokens'; has_advantage says more
