"""The iteration-level scheduler: decode first, prompt chunks within the token budget, `max_num_seqs`, preemption by
recompute when blocks run out (and for a higher priority when the sequences are full), admission on the predicted
first token; and, driving the real decoder runner on tiny-lm, greedy output that preemption does not change."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edge_agent.generation import BlockManager, DecoderConfig, DecoderRunner
from edge_agent.generation.scheduler import GenerationConfig, GenerationScheduler, Rates, Sequence, StepPlan
from edge_agent.scheduling.core import LevelPolicy
from spillway.demo.tiny_lm import TINY, build_tiny_lm_version
from tests.agent.lm_support import greedy_alone

CONTEXT = 512


def _scheduler(blocks: int = 64, block_size: int = 16, **config: Any) -> GenerationScheduler:
    return GenerationScheduler(GenerationConfig(**config), BlockManager(blocks, block_size), Rates())


def _admit(s: GenerationScheduler, prompt: int, *, level: int = 2, at: float = 0.0, max_tokens: int = 16,
           deadline: float | None = None) -> Sequence:  # fmt: skip
    sequence = Sequence(prompt=prompt, max_tokens=max_tokens, level=level, arrival=at, deadline=deadline)
    assert s.admit(sequence, at, context=CONTEXT) is None
    return sequence


def _run(s: GenerationScheduler, plan: StepPlan) -> None:
    s.advance(plan)
    used = sum(len(s.blocks.blocks_of(q)) for q in s.running)
    assert used == s.blocks.used_blocks  # only running sequences hold blocks, and exactly theirs


def test_running_sequences_decode_first_then_prompts_take_chunks_within_the_budget() -> None:
    s = _scheduler(max_num_batched_tokens=40, long_prefill_threshold=32)
    a, b = _admit(s, 10), _admit(s, 20)
    first = s.step()
    assert first.decode == () and [(q, n) for q, n in first.prefill] == [(a, 10), (b, 20)]
    _run(s, first)
    assert a.generated == b.generated == 1  # each prompt's last logits gave its first token
    long = _admit(s, 300, at=1.0)
    second = s.step()
    assert second.decode == (a, b) and second.prefill == ((long, 32),)  # 2 decodes + one chunk at the threshold
    _run(s, second)
    third = s.step()
    assert third.decode == (a, b) and third.prefill == ((long, 32),) and third.tokens <= 40
    assert long.prefilled == 32


def test_max_num_seqs_holds_and_a_higher_priority_preempts_the_lowest_when_full() -> None:
    s = _scheduler(max_num_seqs=2)
    low1, low2 = _admit(s, 8, level=3, at=0.0), _admit(s, 8, level=3, at=0.1)
    _run(s, s.step())
    waiting = _admit(s, 8, level=3, at=0.2)
    plan = s.step()
    assert plan.decode == (low1, low2) and plan.prefill == () and waiting.state == "waiting"
    _run(s, plan)
    urgent = _admit(s, 8, level=1, at=0.3)
    plan = s.step()
    assert plan.preempted == (low2,) and plan.decode == (low1,) and plan.prefill == ((urgent, 8),)
    assert low2.state == "waiting" and low2.preemptions == 1 and not s.blocks.holds(low2)
    _run(s, plan)
    assert [q for q in s.running] == [low1, urgent]


def test_out_of_blocks_the_lowest_latest_is_preempted_and_comes_back_first() -> None:
    s = _scheduler(blocks=4, block_size=4, max_num_seqs=4)
    high = _admit(s, 4, level=1, max_tokens=8)
    low_early, low_late = _admit(s, 3, level=3, at=0.1, max_tokens=8), _admit(s, 3, level=3, at=0.2, max_tokens=8)
    _run(s, s.step())
    assert s.blocks.free_blocks == 1  # 1 + 1 + 1 blocks held, after 3 prompts of at most 4 tokens
    plan = s.step()  # high needs its second block (its 5th token), then low_early's 4th token fits its first block
    assert plan.preempted == () and set(plan.decode) == {high, low_early, low_late}
    _run(s, plan)
    plan = s.step()  # everyone needs a block now: only the lowest, latest ones give theirs up
    assert plan.preempted[0] is low_late and high in plan.decode
    _run(s, plan)
    later = _admit(s, 2, level=3, at=5.0, max_tokens=4)
    order = s._prefill_order()
    assert order.index(low_late) < order.index(later)  # boosted: before its level's newer arrivals
    assert s.preemptions >= 1 and low_late.boosted == 1


def test_admission_refuses_what_cannot_make_its_first_token_deadline() -> None:
    s = GenerationScheduler(GenerationConfig(), BlockManager(256, 16), Rates(prefill_tokens_per_s=1000, step_s=0.01))
    _admit(s, 400, level=2)  # 0.4 s of prefill queued at level 2
    late = Sequence(prompt=100, max_tokens=8, level=2, arrival=0.0, deadline=0.3)
    refused = s.admit(late, 0.0, context=CONTEXT)
    assert refused is not None and refused.reason == "deadline_unmeetable" and "deadline" in refused.message
    assert s.waiting == 1  # nothing queued for it
    urgent = Sequence(prompt=100, max_tokens=8, level=1, arrival=0.0, deadline=0.3)  # level 1 sees nothing ahead
    assert s.admit(urgent, 0.0, context=CONTEXT) is None
    with pytest.raises(ValueError, match="context"):
        s.admit(Sequence(prompt=500, max_tokens=100, level=2, arrival=0.0), 0.0, context=CONTEXT)


def test_admission_counts_the_wait_for_a_place_among_max_num_seqs() -> None:
    def busy(policy: str) -> GenerationScheduler:
        s = GenerationScheduler(GenerationConfig(max_num_seqs=2, queue_policy=policy),  # type: ignore[arg-type]
                                BlockManager(256, 16), Rates(prefill_tokens_per_s=1000, step_s=0.01))  # fmt: skip
        for at in (0.0, 0.1):
            _admit(s, 8, level=3, at=at, max_tokens=100)
        _run(s, s.step())  # both prefilled: each holds its place for 99 more tokens, about 1 s
        return s

    s = busy("priority")
    assert s.predict_first_token_s(3, 8, now=1.0) == pytest.approx(0.99 + 0.008 + 0.01)
    late = Sequence(prompt=8, max_tokens=8, level=3, arrival=1.0, deadline=1.5)
    refused = s.admit(late, 1.0, context=CONTEXT)
    assert refused is not None and refused.reason == "deadline_unmeetable"  # no prefill queued: the places are full
    urgent = Sequence(prompt=8, max_tokens=8, level=1, arrival=1.0, deadline=1.5)
    assert s.admit(urgent, 1.0, context=CONTEXT) is None  # it may preempt a level-3 sequence: no wait for a place
    queued = Sequence(prompt=8, max_tokens=50, level=2, arrival=1.1)
    assert s.admit(queued, 1.1, context=CONTEXT) is None
    # A level-3 arrival now waits for the two queued before it as well: the first place frees after 99 steps and
    # goes to the level-1 one (9 steps), the second to the level-2 one; the first to free after that is its own.
    # Their 16 prompt tokens are prefilled in the steps it waits through.
    assert s.predict_first_token_s(3, 8, now=1.2) == pytest.approx(1.08 + 0.016 + 0.008 + 0.01)
    fcfs = busy("fcfs")  # arrival order: a level-1 request cannot preempt and waits like the others
    assert fcfs.predict_first_token_s(1, 8, now=1.0) == pytest.approx(0.99 + 0.008 + 0.01)


def test_a_lower_levels_wait_is_stretched_by_the_share_of_steps_higher_levels_took() -> None:
    s = GenerationScheduler(GenerationConfig(max_num_seqs=4), BlockManager(256, 16),
                            Rates(prefill_tokens_per_s=1000, step_s=0.01))  # fmt: skip
    for level in (1, 1, 1, 3):
        _admit(s, 4, level=level, max_tokens=300)
    for _ in range(60):  # every step: three level-1 tokens and one level-3 token
        _run(s, s.step())
    assert s._level_share == pytest.approx([0.75, 0.0, 0.25], abs=0.05)  # an EWMA: near, from 0
    tail = 0.008 + 0.01  # its own prefill and a step
    stretched = s.predict_first_token_s(3, 8, now=1.0)
    measured = list(s._level_share)
    s._level_share[:] = [0.0, 0.0, 0.0]
    plain = s.predict_first_token_s(3, 8, now=1.0)  # the places are full: it waits ~239 steps for one
    s._level_share[:] = measured
    assert plain - tail == pytest.approx(2.39, abs=0.02)
    assert stretched - tail == pytest.approx((plain - tail) / (1 - measured[0]))  # level 1 took 3/4 of the steps
    assert s.predict_first_token_s(1, 8, now=1.0) == pytest.approx(tail)  # it may preempt the level-3 one: no wait
    fcfs = GenerationScheduler(GenerationConfig(max_num_seqs=1, queue_policy="fcfs"), BlockManager(256, 16),
                               Rates(prefill_tokens_per_s=1000, step_s=0.01))  # fmt: skip
    _admit(fcfs, 4, level=1, max_tokens=50)
    for _ in range(10):
        _run(fcfs, fcfs.step())
    assert fcfs.predict_first_token_s(3, 8, now=1.0) == pytest.approx(0.4 + tail)  # arrival order: no stretch


def test_a_high_priority_arrival_gets_its_first_token_within_a_few_steps_under_load() -> None:
    s = _scheduler(blocks=512, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_threshold=32)
    lows = [_admit(s, 200, level=3, at=i * 0.01, max_tokens=64) for i in range(8)]
    for _ in range(5):
        _run(s, s.step())
    urgent = _admit(s, 20, level=1, at=1.0)
    steps = 0
    while not urgent.generated and steps < 4:
        _run(s, s.step())
        steps += 1
    assert urgent.generated == 1 and steps <= 2
    assert any(q.state == "waiting" for q in lows)  # it preempted to get in: max_num_seqs was full


def _first_chunks(s: GenerationScheduler, now: float | None = None) -> list[Sequence]:
    """The waiting sequences a step starts, in the order it starts them."""
    plan = s.step(now)
    return [q for q, _ in plan.prefill]


def test_priority_serves_levels_in_order_and_fifo_within_one() -> None:
    s = _scheduler(max_num_seqs=8)
    low, high, mid_early, mid_late = (_admit(s, 4, level=3, at=0.0), _admit(s, 4, level=1, at=0.1),
                                      _admit(s, 4, level=2, at=0.2), _admit(s, 4, level=2, at=0.3))  # fmt: skip
    assert _first_chunks(s) == [high, mid_early, mid_late, low]


def test_fcfs_serves_in_arrival_order_whatever_the_level_and_preempts_the_latest() -> None:
    s = _scheduler(max_num_seqs=2, queue_policy="fcfs")
    low, high = _admit(s, 4, level=3, at=0.0), _admit(s, 4, level=1, at=0.1)
    assert _first_chunks(s) == [low, high]
    urgent = _admit(s, 4, level=1, at=0.2)
    plan = s.step()
    assert plan.preempted == () and urgent.state == "waiting"  # arrival order: nobody outranks a running one
    assert s.predict_first_token_s(1, 4, now=0.3) == s.predict_first_token_s(3, 4, now=0.3)  # levels do not count


def test_fcfs_out_of_blocks_preempts_the_latest_arrival_whatever_its_level() -> None:
    s = _scheduler(blocks=2, block_size=4, max_num_seqs=2, queue_policy="fcfs")
    early_low = _admit(s, 4, level=3, at=0.0, max_tokens=4)
    late_high = _admit(s, 4, level=1, at=1.0, max_tokens=4)
    _run(s, s.step())  # both prefilled: each holds its one block, and each needs a second for its next token
    plan = s.step()  # a review found this asserting (the engine thread died): the victim was already decoding
    assert plan.preempted == (late_high,) and plan.decode == (early_low,)
    _run(s, plan)
    assert late_high.state == "waiting" and late_high.boosted == 1


def test_aging_lets_a_low_level_in_but_never_to_push_out_a_higher_one() -> None:
    s = _scheduler(max_num_seqs=1, aging_s=1.0)
    low = _admit(s, 4, level=3, at=0.0)
    high = _admit(s, 4, level=1, at=0.9)
    first = s.step(0.95)
    assert [q for q, _ in first.prefill] == [high]  # not aged yet: level 1 first
    _run(s, first)
    plan = s.step(1.05)  # low has waited past aging_s, but it may not preempt the running level-1 stream
    assert plan.preempted == () and low.state == "waiting" and plan.decode == (high,)


def test_a_delay_level_is_not_refused_at_arrival_for_its_deadline() -> None:
    policies = (LevelPolicy(default_timeout_s=0.01, timeout_action="DELAY"), LevelPolicy(), LevelPolicy())
    s = GenerationScheduler(GenerationConfig(level_policies=policies), BlockManager(256, 16),
                            Rates(prefill_tokens_per_s=1000, step_s=0.01))  # fmt: skip
    _admit(s, 400, level=1)
    slow = Sequence(prompt=10, max_tokens=8, level=1, arrival=0.0, deadline=s.deadline_for(1, 0.0, None))
    assert s.admit(slow, 0.0, context=CONTEXT) is None  # Triton's DELAY: served late rather than refused


def test_shortest_prompt_first_orders_a_level_by_prompt_left_and_keeps_levels_first() -> None:
    s = _scheduler(max_num_seqs=8, queue_policy="shortest_prompt_first")
    long, short, middle = _admit(s, 60, level=2, at=0.0), _admit(s, 5, level=2, at=0.1), _admit(s, 20, level=2, at=0.2)
    urgent_long = _admit(s, 90, level=1, at=0.3)
    assert _first_chunks(s) == [urgent_long, short, middle, long]
    s2 = _scheduler(queue_policy="shortest_prompt_first")
    _admit(s2, 300, level=2, at=0.0)
    # A short prompt has nothing ahead of it at its level; under `priority` it would wait for the 300 tokens.
    assert s2.predict_first_token_s(2, 10, now=1.0) < _scheduler_with_one_queued(300).predict_first_token_s(2, 10)


def _scheduler_with_one_queued(prompt: int) -> GenerationScheduler:
    s = _scheduler()
    _admit(s, prompt, level=2)
    return s


def test_aging_puts_a_long_waiting_low_level_first_and_only_once_it_has_waited() -> None:
    s = _scheduler(max_num_seqs=1, aging_s=2.0)
    old_low = _admit(s, 4, level=3, at=0.0)
    high = _admit(s, 4, level=1, at=1.0)
    assert s._prefill_order(1.5) == [high, old_low]  # not aged yet
    assert s._prefill_order(2.5) == [old_low, high]  # waited 2.5 s >= aging_s: before every level
    assert _first_chunks(s, 2.5) == [old_low]
    no_aging = _scheduler(max_num_seqs=1)
    _admit(no_aging, 4, level=3, at=0.0)
    high2 = _admit(no_aging, 4, level=1, at=1.0)
    assert _first_chunks(no_aging, 100.0) == [high2]


def test_a_levels_default_first_token_timeout_and_queue_cap_apply_to_requests_without_their_own() -> None:
    policies = (LevelPolicy(default_timeout_s=0.25, allow_timeout_override=True), LevelPolicy(),
                LevelPolicy(max_queue_size=2))  # fmt: skip
    s = GenerationScheduler(GenerationConfig(level_policies=policies), BlockManager(256, 16),
                            Rates(prefill_tokens_per_s=1000, step_s=0.01))  # fmt: skip
    assert s.deadline_for(1, 10.0, None) == 10.25  # the level's default
    assert s.deadline_for(1, 10.0, 0.1) == pytest.approx(10.1)  # a request may shorten it
    assert s.deadline_for(1, 10.0, 5.0) == 10.25  # never lengthen it
    assert s.deadline_for(2, 10.0, None) is None and s.deadline_for(2, 10.0, 0.5) == 10.5
    _admit(s, 400, level=1)  # 0.4 s of prefill queued at level 1
    late = Sequence(prompt=10, max_tokens=8, level=1, arrival=0.0, deadline=s.deadline_for(1, 0.0, None))
    refused = s.admit(late, 0.0, context=CONTEXT)
    assert refused is not None and refused.reason == "deadline_unmeetable"
    _admit(s, 4, level=3), _admit(s, 4, level=3)
    full = s.admit(Sequence(prompt=4, max_tokens=8, level=3, arrival=0.0), 0.0, context=CONTEXT)
    assert full is not None and full.reason == "queue_full" and "level 3" in full.message
    assert s.waiting_at(3) == 2 and s.waiting_at(1) == 1


def test_an_unknown_queue_policy_or_mismatched_level_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="queue_policy"):
        GenerationConfig(queue_policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="level_policies"):
        GenerationConfig(levels=3, level_policies=(LevelPolicy(),))


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> DecoderRunner:
    return DecoderRunner(DecoderConfig.load(build_tiny_lm_version(tmp_path_factory.mktemp("lm"), 1, TINY)))


def _engine_step(s: GenerationScheduler, runner: DecoderRunner, plan: StepPlan) -> None:
    """What the engine thread does with a plan: drop preempted caches, run chunks and the decode batch."""
    for sequence in plan.preempted:
        runner.release(sequence.id)
    for sequence, chunk in plan.prefill:
        tokens: list[int] = sequence.payload  # prompt + generated
        known = tokens[: sequence.prompt + max(sequence.generated - 1, 0)]
        logits = runner.prefill(sequence.id, known[sequence.prefilled : sequence.prefilled + chunk])
        if sequence.prefilled + chunk == len(known) and sequence.generated == 0:
            tokens.append(int(logits.argmax()))
    if plan.decode:
        logits = runner.decode([q.id for q in plan.decode], [q.payload[-1] for q in plan.decode])
        for row, sequence in enumerate(plan.decode):
            sequence.payload.append(int(logits[row].argmax()))
    s.advance(plan)
    for sequence in plan.decode + tuple(q for q, _ in plan.prefill):
        if sequence.state == "finished":
            runner.release(sequence.id)


def test_preemption_and_recompute_leave_greedy_output_unchanged(runner: DecoderRunner) -> None:
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 23, 11, 17, 2, 30)]
    steps = 12
    expected = [greedy_alone(runner, p, steps) for p in prompts]
    # Few blocks, so that sequences growing past their blocks preempt each other, and a small budget and
    # threshold, so that prompts are prefilled in chunks beside running decodes.
    s = _scheduler(blocks=9, block_size=8, max_num_seqs=4, max_num_batched_tokens=16, long_prefill_threshold=8)
    sequences = []
    for i, prompt in enumerate(prompts):
        sequence = Sequence(prompt=len(prompt), max_tokens=steps, level=1 + i % 3, arrival=i * 0.1,
                            payload=list(prompt))  # fmt: skip
        assert s.admit(sequence, sequence.arrival, context=CONTEXT) is None
        sequences.append(sequence)
    for _ in range(500):
        if s.idle:
            break
        _engine_step(s, runner, s.step())
    assert s.idle and s.blocks.used_blocks == 0 and runner.caches == {}
    assert s.preemptions > 0  # the budget did force recomputes
    assert [q.payload[q.prompt :] for q in sequences] == expected


def test_lowered_limits_let_running_sequences_finish_and_admit_nobody_until_under_them() -> None:
    s = _scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(4):
        _admit(s, 8, level=3, at=0.01 * i, max_tokens=4 + i)
    _run(s, s.step())
    assert len(s.running) == 4
    s.limit(max_num_seqs=2, max_num_batched_tokens=1000)  # the budget never above the configured one
    assert (s.config.max_num_seqs, s.config.max_num_batched_tokens) == (2, 64)
    urgent = _admit(s, 8, level=1, at=1.0)  # would preempt a lower level were the sequences only full
    queued = _admit(s, 8, level=3, at=1.1)
    over = 0
    while urgent.state == "waiting":
        before = len(s.running)
        plan = s.step()
        if before > 2:  # over the limit nobody joins, nor swaps in by preemption: the running ones finish
            over += 1
            assert plan.preempted == () and len(s.running) <= before
        assert len(s.running) <= max(before, 2)
        _run(s, plan)
    assert over > 0 and len(s.running) <= 2  # (at the limit, a higher level may still preempt its way in)
    # Reverting restores the configured limits: the queued one joins beside the others at once.
    s.limit()
    assert (s.config.max_num_seqs, s.config.max_num_batched_tokens) == (4, 64) and s.config == s.configured
    _run(s, s.step())
    assert queued.state == "running"


def test_the_sequences_never_exceed_the_lowered_budget_and_the_prediction_counts_the_excess() -> None:
    s = _scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    s.limit(max_num_batched_tokens=3)  # a decode token each: at most 3 sequences
    assert (s.config.max_num_seqs, s.config.max_num_batched_tokens) == (3, 3)
    s.limit(max_num_seqs=8)
    assert s.config.max_num_seqs == 4  # never above the configured one
    s = _scheduler(max_num_seqs=4)
    for i in range(4):
        _admit(s, 8, level=2, at=0.01 * i, max_tokens=10 * (i + 1))
    _run(s, s.step())
    full = s.predict_first_token_s(2, 8, 1.0)
    s.limit(max_num_seqs=2)  # a place frees only once three of the four have ended: later than one of four
    assert s.predict_first_token_s(2, 8, 1.0) > full
