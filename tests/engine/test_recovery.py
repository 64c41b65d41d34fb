"""The rules of `--on-engine-failure restart` (engine/recovery.py): the budget and the
suspects of a poison request, without processes."""

from __future__ import annotations

import pytest

from otel_engine.config import EngineConfig, RecoveryConfig
from otel_engine.engine.recovery import Isolation, RecoveryPolicy, RestartBudget

SEGV = "EngineCoreDied in engine_core"
RAISE = "InjectedFault in engine_core"


def always(_: str) -> bool:
    return True


def test_the_budget_allows_n_restarts_in_any_window() -> None:
    budget = RestartBudget(max_restarts=2, window_s=10.0)

    assert budget.take(0.0)
    assert budget.take(1.0)
    assert not budget.take(2.0)  # a third within 10 s of the first
    assert budget.take(10.0)  # the first left the window
    assert not budget.take(10.5)
    assert not RestartBudget(max_restarts=0, window_s=10.0).take(0.0)


def test_the_requests_at_their_first_step_are_the_suspects() -> None:
    """A request that kills the engine does so at its first step: only the batch's
    requests without a token are suspects."""
    isolation = Isolation()

    assert isolation.blame(["a", "b", "new"], {"new", "elsewhere"}, SEGV) is None
    assert ["new"] == _trial_order(isolation)


def test_a_failure_in_a_step_of_decodes_has_no_suspect() -> None:
    isolation = Isolation()

    assert isolation.blame(["a", "b", "c"], set(), SEGV) is None
    assert 0 == isolation.num_suspects


def test_suspects_go_on_trial_one_at_a_time_and_the_same_failure_again_names_the_poison() -> None:
    isolation = Isolation()
    live = {"a", "b", "c", "d"}

    assert isolation.blame(["a", "b", "c", "d"], {"a", "b", "c"}, SEGV) is None
    assert isolation.is_suspect("a")
    assert not isolation.is_suspect("d")
    assert "a" == isolation.next_trial(live.__contains__)
    assert isolation.next_trial(live.__contains__) is None  # one at a time
    assert isolation.cleared("a")  # its first token: the next may go
    assert not isolation.is_suspect("a")
    assert "b" == isolation.next_trial(live.__contains__)
    # The same failure, and the request on trial is its batch's only request without a
    # token: the poison.
    assert "b" == isolation.blame(["a", "b", "d"], {"b"}, SEGV)
    assert not isolation.is_suspect("b")
    assert "c" == isolation.next_trial(live.__contains__)


def test_another_failure_during_a_trial_names_no_poison() -> None:
    isolation = Isolation()
    isolation.blame(["a"], {"a"}, SEGV)
    assert "a" == isolation.next_trial(always)

    assert isolation.blame(["a", "b"], {"a"}, RAISE) is None  # not what made it a suspect
    assert ["a"] == _trial_order(isolation)


def test_a_trial_that_fails_another_way_makes_that_failure_the_one_a_verdict_needs() -> None:
    """A poison that became a suspect in the batch of an unrelated failure (a SIGKILL) is
    failed at its second trial, not tried again forever (each try a restart)."""
    isolation = Isolation()
    isolation.blame(["a", "poison"], {"poison"}, SEGV)
    assert "poison" == isolation.next_trial(always)
    assert isolation.blame(["a", "poison"], {"poison"}, RAISE) is None  # its own failure
    assert "poison" == isolation.next_trial(always)

    assert "poison" == isolation.blame(["a", "poison"], {"poison"}, RAISE)
    assert 0 == isolation.num_suspects


def test_a_failure_with_another_request_at_its_first_step_names_no_poison() -> None:
    isolation = Isolation()
    isolation.blame(["a"], {"a"}, SEGV)
    assert "a" == isolation.next_trial(always)

    # "late" ran its first step with the trial: either may be the one.
    assert isolation.blame(["a", "late", "c"], {"a", "late"}, SEGV) is None
    assert ["a", "late"] == _trial_order(isolation)


def test_a_request_on_trial_outside_the_failing_batch_waits_for_its_trial_again() -> None:
    isolation = Isolation()
    isolation.blame(["a", "b"], {"a", "b"}, SEGV)
    assert "a" == isolation.next_trial(always)

    assert isolation.blame(["c"], {"c"}, SEGV) is None  # "a" was not in the batch
    assert ["a", "b", "c"] == _trial_order(isolation)


def test_ended_requests_leave_the_suspects() -> None:
    isolation = Isolation()
    isolation.blame(["a", "b", "c"], {"a", "b", "c"}, SEGV)
    isolation.forget("b")
    assert "a" == isolation.next_trial(always)
    isolation.forget("a")  # its client went away during its trial
    assert isolation.on_trial is None
    assert "c" == isolation.next_trial(lambda request_id: request_id != "x")
    assert 1 == isolation.num_suspects
    isolation.cleared("c")
    assert 0 == isolation.num_suspects
    assert isolation.next_trial(always) is None


def test_a_dead_suspect_is_skipped() -> None:
    isolation = Isolation()
    isolation.blame(["a", "b"], {"a", "b"}, SEGV)
    assert "b" == isolation.next_trial(lambda request_id: request_id == "b")
    assert 1 == isolation.num_suspects


def test_a_suspect_its_client_holds_keeps_its_place_until_released() -> None:
    isolation = Isolation()
    isolation.blame(["a", "b"], {"a", "b"}, SEGV)
    held = {"a"}

    assert "b" == isolation.next_trial(always, lambda r: r not in held)
    assert isolation.cleared("b")
    assert isolation.next_trial(always, lambda r: r not in held) is None
    assert isolation.is_suspect("a")
    held.clear()
    assert "a" == isolation.next_trial(always, lambda r: r not in held)


def test_only_a_suspect_that_could_go_on_trial_holds_new_requests_back() -> None:
    isolation = Isolation()
    isolation.blame(["a"], {"a"}, SEGV)

    assert not isolation.has_ready(lambda r: r != "a")  # its client holds it
    assert isolation.has_ready(always)


def test_failures_pinned_on_a_poison_request_are_not_charged_but_are_bounded() -> None:
    policy = RecoveryPolicy(
        RecoveryConfig("restart", max_engine_restarts=1, engine_restart_window=60.0)
    )

    assert (True, None) == policy.on_failure(["a", "b", "c"], {"a", "b"}, SEGV, 0.0)
    assert "a" == policy.isolation.next_trial(always)
    assert (True, "a") == policy.on_failure(["a", "c"], {"a"}, SEGV, 1.0)  # the poison: free
    assert "b" == policy.isolation.next_trial(always)
    # Another poison at once: the allowance (as many as the budget) is spent, and so is
    # the budget: the server shuts down.
    assert (False, "b") == policy.on_failure(["b"], {"b"}, SEGV, 2.0)
    assert (True, None) == policy.on_failure([], set(), SEGV, 61.0)  # the window moved on


@pytest.mark.parametrize(
    "bad",
    [
        {"on_engine_failure": "sometimes"},
        {"max_engine_restarts": -1},
        {"engine_restart_window": 0.0},
    ],
)
def test_the_recovery_options_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig.from_kwargs(**bad)


def test_the_offline_engine_refuses_restarts() -> None:
    from otel_engine import LLM

    with pytest.raises(ValueError, match="the server's"):
        LLM(on_engine_failure="restart")


def _trial_order(isolation: Isolation) -> list[str]:
    order = []
    while (request_id := isolation.next_trial(always)) is not None:
        order.append(request_id)
        assert isolation.cleared(request_id)
    return order


def test_a_carried_over_output_must_fit_the_request() -> None:
    """The engine core checks the tokens a restarted engine is given as output: at least one
    token left to generate, each in the vocabulary."""
    from otel_engine.engine.validation import check_request
    from otel_engine.errors import RequestError
    from otel_engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4)
    check = {"vocab_size": 100, "max_model_len": 64}
    check_request([1, 2], params, output_token_ids=[5, 6, 7], **check)  # one left
    for output in ([5, 6, 7, 8], [5, 100]):
        with pytest.raises(RequestError, match="carried-over output"):
            check_request([1, 2], params, output_token_ids=output, **check)


def test_past_the_wait_queue_a_new_request_gets_retry_after() -> None:
    """While the engine restarts, up to RECOVERY_WAIT_QUEUE requests wait; the next one is
    refused with the last restart's duration, answered as 503 with Retry-After."""
    import asyncio
    from types import SimpleNamespace

    from otel_engine.engine.recovery import RECOVERY_WAIT_QUEUE
    from otel_engine.engine.restarter import Restarter
    from otel_engine.entrypoints.network.errors import from_engine_error
    from otel_engine.errors import EngineRecoveringError

    restarter = Restarter(EngineConfig().recovery, SimpleNamespace())  # type: ignore[arg-type]
    restarter.is_recovering, restarter.restart_s = True, 2.4

    async def crowd() -> EngineRecoveringError:
        waiting = [asyncio.create_task(restarter.wait()) for _ in range(RECOVERY_WAIT_QUEUE)]
        await asyncio.sleep(0)
        with pytest.raises(EngineRecoveringError) as refused:
            await restarter.wait()
        restarter.wake(None)
        await asyncio.gather(*waiting)  # the others go on once the restart ends
        return refused.value

    error = from_engine_error(asyncio.run(crowd()))
    assert (503, "engine_recovering", {"Retry-After": "3"}) == (
        error.status,
        error.code,
        error.headers,
    )


def test_a_deaths_signature_says_how_the_process_died() -> None:
    """Two deaths of the engine core are one failure only when it died the same way (an
    outside SIGKILL is not the exit of an injected fault); an exception is its type in its
    process, whatever its message says of the step."""
    from otel_engine.engine.recovery import failure_signature
    from otel_engine.ipc.messages import ErrorInfo

    def died(message: str) -> str:
        return failure_signature(ErrorInfo(type="EngineCoreDied", message=message, process="x"))

    def raised(message: str) -> str:
        return failure_signature(ErrorInfo(type="InjectedFault", message=message, process="x"))

    assert died("the engine core was killed by signal 9") != died("the engine core exited 3")
    assert died("the engine core died of SIGSEGV in f at k.c:1") == died(
        "the engine core died of SIGSEGV in f at k.c:1"
    )
    assert raised("fault at step 3") == raised("fault at step 9")
