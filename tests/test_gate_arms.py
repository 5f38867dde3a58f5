"""The draft gate's measured arms (tandem.engine.gate_arms): windows of steps per regime and
concurrency bucket, the faster regime chosen, the slower explored within a budget; and the gate
with its cost model wrong both ways, in a simulated world of true step costs."""
import pytest

from tandem.engine.draft_gate import DraftGate, StepCosts
from tandem.engine.gate_arms import GateArms, bucket


def test_buckets_round_the_requests_to_a_power_of_two():
    assert [bucket(r) for r in (1, 2, 3, 5, 6, 11, 12, 22, 23, 45, 46, 64, 90)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6]


def test_arms_measure_both_regimes_and_run_the_faster():
    """Nothing measured: the cost model decides (None). A window of drafting (16 counted steps,
    the switch's uncounted step apart) makes plain decoding run at once; its steps count once
    they are steady; then the faster regime runs."""
    arms = GateArms(window=16, budget=0.02)
    assert arms.choose(64) is None
    arms.observe(64, True, 64 * 5, 0.050, counts=False)  # the first drafting step: a restart
    for _ in range(16):
        assert arms.choose(64) is None  # (a window not yet ended)
        arms.observe(64, True, 64 * 5, 0.006, counts=True)  # 320 tokens in 6 ms
    on = arms.buckets[6].on
    assert on.windows == 1 and on.per_s() == pytest.approx(320 / 0.006)
    assert arms.buckets[6].entry_on == pytest.approx((0.050, 320))  # (its steps before they counted)
    assert arms.choose(64) is False and arms.exploring == (6, False) and arms.explorations == 1
    for _ in range(4):  # plain steps that still feed the drafters: the switch's
        arms.observe(64, False, 64, 0.0016, counts=False)
    for _ in range(15):
        assert arms.choose(64) is False
        arms.observe(64, False, 64, 0.001, counts=True)
    assert arms.choose(64) is False and arms.exploring == (6, False)  # (still exploring: 15 of 16)
    arms.observe(64, False, 64, 0.001, counts=True)
    assert arms.exploring is None and arms.buckets[6].off.per_s() == pytest.approx(64 / 0.001)
    assert arms.buckets[6].entry_off == pytest.approx((4 * 0.0016, 4 * 64))
    assert arms.choose(64) is False  # 64 tokens a ms against 53: plain decoding
    assert arms.choose(8) is None  # (another bucket: nothing measured there)
    assert "R~64: on 53333/1 off 64000/1 tok/s/windows, switches 50.0 / 6.4 ms" in arms.summary()


def test_the_slower_regime_is_explored_within_the_budget():
    """The loser runs a window again once its expected loss (the window at the measured ratio, and
    both switches) is within `budget` of the bucket's time since the last exploration."""
    arms = GateArms(window=16, budget=0.02)
    for _ in range(16):
        arms.observe(64, True, 320, 0.006, counts=True)
    arms.choose(64)
    for _ in range(16):
        arms.observe(64, False, 64, 0.001, counts=True)
    bk = arms.buckets[6]
    # a window of drafting: 16 x 6 ms at 53.3 / 64 of the rate; switches never seen: a window of
    # each regime's steps making nothing
    loss = 16 * 0.006 * (1 - (320 / 6) / 64) + 16 * 0.006 + 16 * 0.001
    assert bk.since == 0.0
    n = 0
    while arms.choose(64) is False:
        arms.observe(64, False, 64, 0.001, counts=True)
        n += 1
    assert n == pytest.approx(loss / 0.02 / 0.001, abs=1) and arms.exploring == (6, True)


def test_a_window_cut_short_by_a_probe_or_a_new_bucket_counts_only_past_half():
    arms = GateArms(window=16)
    for _ in range(7):
        arms.observe(64, True, 320, 0.006, counts=True)
    arms.observe(64, None, 100, 0.003, counts=True)  # a probe: in neither regime, the window ends
    assert arms.buckets[6].on.windows == 0
    for _ in range(8):
        arms.observe(64, True, 320, 0.006, counts=True)
    arms.observe(32, True, 160, 0.004, counts=True)  # another bucket: 8 steps are half a window
    assert arms.buckets[6].on.windows == 1 and arms.buckets[6].entry_on is None


def simulate(gate: DraftGate, steps: int, r: int, plain_s: float, draft_s: float, a: float,
             restart_s: float = 0.0, fed_plain_s: float | None = None) -> tuple[float, float, int]:
    """The gate deciding `steps` steps of R requests in a world of true costs: a plain step
    plain_s (fed_plain_s while the drafters are not dormant), a drafting step draft_s (plus
    restart_s after plain steps: its drafters restart), a probe plain_s plus its share of
    drafting's extra; a accepted tokens a drafted request. Steadiness as the engine reports
    it. Returns (tokens, seconds, drafting steps)."""
    tokens = seconds = 0.0
    on_steps = 0
    prev = None
    for _ in range(steps):
        k = gate.plan(r)
        if k >= r:
            s, made, steady = draft_s + (restart_s if prev != r else 0.0), r * (1 + a), prev == r
            on_steps += 1
        elif k == 0:
            s = plain_s if gate.dormant else (fed_plain_s or plain_s)
            made, steady = r, prev == 0
        else:
            s, made, steady = plain_s + (draft_s - plain_s) * k / r, r + a * k, prev == k
        gate.observe(r, k, s, int(made - r), steady=steady)
        tokens, seconds, prev = tokens + made, seconds + s, k
    return tokens, seconds, on_steps


def test_measured_rates_overrule_a_cost_model_that_favours_drafting():
    """The start-up curves put a plain step at 3 ms at 64 requests (measured with every drafter
    fed, say); it takes 1 ms. A drafting step takes 6 ms, and with 4 accepted tokens a request
    plain decoding (64 tokens a ms) beats drafting (53). The model alone drafts throughout: no
    plain step of the off regime ever corrects it. With arms the gate turns drafting off after a
    window of each and keeps within 3% of plain decoding's rate (its budget, 2%, explores drafting
    again every 2.8 s here: a window and a restart of the drafters). (Without min_plain: the model
    now measures steady plain steps before it first drafts for every request, and then keeps
    drafting off too.)"""
    costs = StepCosts((1, 64), plain=(0.003, 0.003), drafting=(0.004, 0.004))
    world = dict(r=64, plain_s=0.001, draft_s=0.006, a=4.0, restart_s=0.030, fed_plain_s=0.0016)
    model = DraftGate(costs, min_plain=0)
    t, s, on = simulate(model, 3000, **world)
    assert on > 2900 and t / s < 0.85 * 64 / 0.001
    t, s, on = simulate(DraftGate(costs), 3000, **world)  # (min_plain: the plain step measured first)
    assert on < 100
    gate = DraftGate(costs, arms=GateArms(), min_plain=0)
    t, s, on = simulate(gate, 10000, **world)
    assert on < 100 and t / s > 0.97 * 64 / 0.001
    assert gate.arms.buckets[6].off.per_s() > gate.arms.buckets[6].on.per_s()


def test_measured_rates_keep_drafting_where_the_model_feared_its_cost():
    """The start-up curves say drafting costs 20 ms at 8 requests; it costs 2 ms and pays 2.5x.
    The model's probes correct its cost and turn drafting on; then both regimes are measured and
    drafting stays on, plain decoding explored again within the budget."""
    costs = StepCosts((1, 8), plain=(0.001, 0.001), drafting=(0.020, 0.020))
    gate = DraftGate(costs, arms=GateArms(budget=0.02))
    world = dict(r=8, plain_s=0.001, draft_s=0.002, a=4.0, restart_s=0.002, fed_plain_s=0.0015)
    simulate(gate, 1500, **world)
    bk = gate.arms.buckets[3]
    assert bk.on.per_s() == pytest.approx(40 / 0.002) and bk.off.per_s() == pytest.approx(8 / 0.001)
    explored = gate.arms.explorations
    t, s, on = simulate(gate, 5000, **world)
    assert gate.arms.explorations > explored and on > 0.9 * 5000
    assert 0.97 * 40 / 0.002 < t / s < 40 / 0.002
