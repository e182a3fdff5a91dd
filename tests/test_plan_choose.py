"""The measured choice among the cost model's best plans (``plan.choose``, ``train.plan_trial``): a fake step
timer whose times are given, so the winner is known."""

from __future__ import annotations

import numpy as np
import pytest

from embedscale.plan.autoplan import make_auto_plan
from embedscale.plan.choose import DEFAULT_MARGIN, close_plans, measured_choice, prediction_margin, trial_plans
from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.specs import TableSpec, Topology
from embedscale.train.plan_trial import candidate_plans


class Timer:
    """A fake step timer: each plan's step seconds given; the plans it was asked for, in order."""

    def __init__(self, steps):
        self.steps, self.calls = steps, []

    def __call__(self, name):
        self.calls.append(name)
        return self.steps[name]


def test_the_fastest_measured_is_kept_though_the_model_ranked_it_second():
    # the model: a 1.00, b 1.04 (within 10% of a), c 1.30 (not); measured: a median 50 ms, b median 30 ms
    plans = [{"name": "c", "predicted_seconds": 1.30}, {"name": "a", "predicted_seconds": 1.00},
             {"name": "b", "predicted_seconds": 1.04}]
    t = Timer({"a": [0.05, 0.06, 0.05], "b": [0.03, 0.02, 0.09], "c": [0.001]})
    out = measured_choice(plans, 0.10, t)
    assert out["chosen"] == "b" and out["trial"] is True
    assert t.calls == ["a", "b"]  # c is outside the margin: never run, though it would have measured fastest
    got = {c["name"]: c["measured_median_seconds"] for c in out["candidates"]}
    assert got == {"a": pytest.approx(0.05), "b": pytest.approx(0.03)}
    assert out["trial_seconds"] >= 0.0


def test_one_clear_winner_runs_no_trial():
    plans = [{"name": "a", "predicted_seconds": 1.0}, {"name": "b", "predicted_seconds": 1.2}]
    t = Timer({})
    out = measured_choice(plans, 0.10, t)
    assert out["chosen"] == "a" and out["trial"] is False and t.calls == [] and out["trial_seconds"] == 0.0


def test_close_plans_margin_and_limit_by_hand():
    plans = [{"name": n, "predicted_seconds": s} for n, s in (("a", 2.0), ("b", 2.2), ("c", 2.21), ("d", 2.1))]
    assert [p["name"] for p in close_plans(plans, 0.10)] == ["a", "d", "b"]  # 2.2 <= 2.0 x 1.1; 2.21 is not
    assert [p["name"] for p in close_plans(plans, 0.5, limit=2)] == ["a", "d"]
    assert prediction_margin({"prediction_error": -0.07}) == pytest.approx(0.07)
    assert prediction_margin({}) == DEFAULT_MARGIN == 0.10


def test_the_candidates_of_an_auto_plan_are_its_own_and_the_other_plans_it_weighed():
    """The auto plan first (the forms it chose), then each other fitting plan once: a rule whose forms are the
    auto plan's (the rule that won) is not a second candidate."""
    tabs = [TableSpec("big", 2_000_000, 16), TableSpec("small", 5_000, 16)]
    prof = ZipfProfile.from_tables(tabs, alpha=0.9, samples=1_000_000)
    plan = make_auto_plan(tabs, prof, Topology(ranks_per_host=2), device_memory=8 * 2**20, host_memory=0,
                          batch_size=1024, tt_rank_list=(64,), other_budgets=False, hot_row_touch=0.0)
    cands = candidate_plans(plan.meta["auto"])
    assert cands[0]["name"] == "auto"
    assert cands[0]["table_forms"] == {"big": plan.forms["big"].to_dict()}  # the sharded table left out
    forms = [c["table_forms"] for c in cands]
    assert all(forms.count(f) == 1 for f in forms)
    assert "search" in [c["name"] for c in cands]  # the search's own plan (TT rank 64) is one of them
    assert all(np.isfinite(c["predicted_seconds"]) for c in cands)
    assert cands[0]["predicted_seconds"] == min(c["predicted_seconds"] for c in cands)


# -- the prediction error out of sample (calibrate --ranks: each plan predicted by a fit on the others) -----------

_COUNTS = {  # calibrate --ranks' five plans: tables per form kind, and the per-step terms they pay
    "sharded": {"sharded": 26, "tt": 0, "host": 0, "host_step": 0, "host_tt_step": 0},
    "tt": {"sharded": 21, "tt": 5, "host": 0, "host_step": 0, "host_tt_step": 0},
    "host": {"sharded": 21, "tt": 0, "host": 5, "host_step": 1, "host_tt_step": 0},
    "host-few": {"sharded": 24, "tt": 0, "host": 2, "host_step": 1, "host_tt_step": 0},
    "tt-host": {"sharded": 21, "tt": 3, "host": 2, "host_step": 1, "host_tt_step": 1}}
_PRED = {"sharded": 0.040, "tt": 0.030, "host": 0.050, "host-few": 0.045, "tt-host": 0.035}


def _machine(extra):
    """A synthetic machine: every plan's step 1.5x the single-process prediction, plus ``extra`` seconds."""
    return [{"tables": _COUNTS[k], "predicted_s": _PRED[k], "measured_s": 1.5 * _PRED[k] + extra.get(k, 0.0)}
            for k in _COUNTS]


def test_held_out_errors_on_a_synthetic_machine_whose_costs_are_known():
    from embedscale.plan.step import held_out_errors

    # the model is right (a common scale, no overhead): every plan predicted out of sample exactly
    errs = held_out_errors(_machine({}))
    assert all(e is None or abs(e) < 1e-9 for e in errs) and sum(e is not None for e in errs) >= 3, errs
    # the machine costs 5 ms more when host and TT tables run together, which only the tt-host plan shows: fitted
    # on the others (scale 1.5 exactly, no overhead), it is predicted at 1.5 x 35 = 52.5 ms against 57.5 ms
    errs = dict(zip(_COUNTS, held_out_errors(_machine({"tt-host": 0.005}))))
    assert errs["tt-host"] == pytest.approx(0.0525 / 0.0575 - 1, rel=1e-9)


def test_choose_by_trial_keeps_the_candidate_the_fake_timer_measured_fastest(tmp_path, monkeypatch):
    """The run's trial (``train.plan_trial.choose_by_trial``) with a fake step timer: the candidates in the model's
    order take 30, 20 and 10 ms, so the third is kept though the model ranked it last; the plan returned is built
    with that candidate's forms, and the explain data records the choice and every candidate's timing."""
    from embedscale.specs import RunConfig
    from embedscale.train import plan_trial

    tabs = [TableSpec("big", 2_000_000, 16), TableSpec("mid", 300_000, 16), TableSpec("small", 5_000, 16)]
    prof = ZipfProfile.from_tables(tabs, alpha=0.9, samples=1_000_000)
    topo = Topology(ranks_per_host=2)
    plan = make_auto_plan(tabs, prof, topo, device_memory=24 * 2**20, host_memory=256 * 2**20, batch_size=1024,
                          other_budgets=False, hot_row_touch=0.0)
    cands = plan_trial.candidate_plans(plan.meta["auto"])
    close, _ = trial_plans(cands, 5.0)
    assert len(close) >= 3
    times = {str(i): 0.01 * (len(close) - i) for i in range(len(close))}  # the model's last, the fastest
    seen = []

    def fake_time(cfg, plan_dir, run_dir, steps):  # a run's steady median and the steps it is taken over
        seen.append(plan_dir.parent.name)
        return times[plan_dir.parent.name], 3 + int(plan_dir.parent.name)

    monkeypatch.setattr(plan_trial, "_time", fake_time)
    cfg = RunConfig()
    cfg.dist.nproc, cfg.dist.plan_trial_steps, cfg.train.batch_size = 2, 5, 2048
    out = plan_trial.choose_by_trial(cfg, plan, None, tabs, prof, topo, tmp_path / "plan", False,
                                     {"prediction_error": 5.0})
    assert seen == [str(i) for i in range(len(close))]
    mc = out.meta["auto"]["measured_choice"]
    assert mc["chosen"] == close[-1]["name"] and mc["trial"] is True
    assert [c["measured_median_seconds"] for c in mc["candidates"]] == [times[str(i)] for i in range(len(close))]
    assert [c["steps_timed"] for c in mc["candidates"]] == [3 + i for i in range(len(close))]  # each run's steps
    want = {n: f["kind"] for n, f in close[-1]["table_forms"].items()}
    assert {n: f.kind for n, f in out.forms.items() if f.kind != "sharded"} == want
    assert out.meta["auto"]["chosen_by"] == f"measured: {close[-1]['name']}"
    assert mc["trial_seconds"] >= mc["build_seconds"] >= 0.0  # building the candidates is the trial's cost too
    # a calibration error of 0.0001%: the next plan is slower by more than that (the whole step's prediction), so
    # only the auto plan is close: nothing is timed, the plan is kept
    assert len(trial_plans(cands, 1e-6)[0]) == 1
    seen.clear()
    same = plan_trial.choose_by_trial(cfg, plan, None, tabs, prof, topo, tmp_path / "plan2", False,
                                      {"prediction_error": 1e-6})
    assert same is plan and seen == [] and same.meta["auto"]["measured_choice"]["trial"] is False


# -- the rule families' best plans in the trial --------------------------------------------------------------------

def _hand_plans():
    """The model's four closest plans are the search's variants (100-103 ms); EL-Rec's rule at rank 8 (best 104,
    another threshold 105), the mixture at rank 16 (best 108, another 109) and EL-Rec's rule at rank 32 (125) are
    further off."""
    rows = [("auto", 100, "search"), ("s2", 101, "search"), ("s3", 102, "search"), ("s4", 103, "search"),
            ("el8 >= 1M", 104, "EL-Rec rule, TT rank 8"), ("el8 >= 2M", 105, "EL-Rec rule, TT rank 8"),
            ("mix16 a", 108, "mixture, TT rank 16"), ("mix16 b", 109, "mixture, TT rank 16"),
            ("el32", 125, "EL-Rec rule, TT rank 32")]
    return [{"name": n, "predicted_seconds": ms / 1e3, "family": f} for n, ms, f in rows]


def test_a_rule_familys_best_plan_enters_the_trial_when_within_the_margin():
    """Worked by hand: with a 20% margin (<= 120 ms) the trial times the 3 closest plans and the best of each
    family within it (el8 >= 1M at 104, mix16 a at 108), not a family's second plan nor el32 (125 ms); with 30%
    el32 enters too; with room for 4 plans the mixture is left out, and named."""
    names = lambda ps: [p["name"] for p in ps]  # noqa: E731
    got, left = trial_plans(_hand_plans(), 0.20)
    assert names(got) == ["auto", "s2", "s3", "el8 >= 1M", "mix16 a"] and left == []
    got, left = trial_plans(_hand_plans(), 0.30)
    assert names(got) == ["auto", "s2", "s3", "el8 >= 1M", "mix16 a", "el32"]
    got, left = trial_plans(_hand_plans(), 0.20, max_plans=4)
    assert names(got) == ["auto", "s2", "s3", "el8 >= 1M"] and left == ["mixture, TT rank 16"]
    # a family among the closest is covered by it: no second plan of that family
    plans = _hand_plans()
    plans[1]["family"] = "EL-Rec rule, TT rank 8"
    assert names(trial_plans(plans, 0.20)[0]) == ["auto", "s2", "s3", "mix16 a"]


def test_the_measured_choice_keeps_a_mispriced_rule_the_model_ranked_outside_its_closest():
    """The model ranks the mixture sixth (108 ms); the fake timer measures it fastest (90 ms against 100-140): it is
    kept. The family's second plan and the plans outside the margin are never run."""
    t = Timer({"auto": [0.10, 0.11], "s2": [0.12], "s3": [0.13], "el8 >= 1M": [0.14], "mix16 a": [0.09, 0.08, 0.12],
               "el32": [0.01]})
    out = measured_choice(_hand_plans(), 0.20, t)
    assert out["chosen"] == "mix16 a" and out["trial"] is True
    assert t.calls == ["auto", "s2", "s3", "el8 >= 1M", "mix16 a"]
    assert {c["name"]: c["families"] for c in out["candidates"]}["mix16 a"] == ["mixture, TT rank 16"]


def test_the_margin_is_relative_to_the_whole_step():
    """An explain report worked by hand: the search's plan costs 20 ms of embedding, a mixture 40 ms; every plan
    pays 67.5 ms more (the dense model and the fixed terms; step 90 ms, embedding 22.5 ms). Relative to the whole
    step the mixture is 107.5 / 87.5 - 1 = 22.9% above the search's plan: within a 29% error, so timed; by the
    embedding part alone it would be 100% above, and left out."""
    tf = {"kind": "tt", "tt_rank": 8}
    rep = {"chosen_by": "search", "plan_model_seconds": 0.020, "predicted_step_seconds": 0.090,
           "predicted_embedding_step_seconds": 0.0225,
           "rules": [{"rule": "search", "family": "search", "predicted_seconds": 0.020, "fits": True,
                      "table_forms": {"a": tf}},
                     {"rule": "mix", "family": "mixture, TT rank 8", "predicted_seconds": 0.040, "fits": True,
                      "table_forms": {"a": tf, "b": {"kind": "host"}}},
                     {"rule": "big", "family": "EL-Rec rule, TT rank 8", "predicted_seconds": 0.050, "fits": False,
                      "table_forms": {"b": tf}}]}
    cands = candidate_plans(rep)
    assert [(c["name"], round(c["predicted_seconds"], 6)) for c in cands] == [("auto", 0.0875), ("mix", 0.1075)]
    assert cands[0]["families"] == ["search"]
    assert [c["name"] for c in trial_plans(cands, 0.29)[0]] == ["auto", "mix"]
    assert [c["name"] for c in trial_plans(cands, 0.22)[0]] == ["auto"]


def test_the_trials_prediction_errors_worked_by_hand():
    """Three candidates predicted 100, 110, 120 ms, measured 200, 220, 300 ms: errors -50%, -50%, -60%; each
    prediction scaled by the median measured / predicted of the other two (out of sample), worked below."""
    t = Timer({"a": [0.200], "b": [0.220], "c": [0.300]})
    plans = [{"name": n, "predicted_seconds": s} for n, s in (("a", 0.100), ("b", 0.110), ("c", 0.120))]
    out = measured_choice(plans, 0.5, t)
    got = {c["name"]: (c["prediction_error"], c["scaled_error"]) for c in out["candidates"]}
    # ratios measured / predicted: a 2.0, b 2.0, c 2.5; a's others: median(2.0, 2.5) = 2.25 -> 225 / 200 - 1
    assert got["a"] == (pytest.approx(-0.5), pytest.approx(0.125))
    assert got["b"] == (pytest.approx(-0.5), pytest.approx(0.110 * 2.25 / 0.220 - 1))
    assert got["c"] == (pytest.approx(0.120 / 0.300 - 1), pytest.approx(0.120 * 2.0 / 0.300 - 1))


def test_a_candidate_that_cannot_run_is_not_chosen_and_the_report_says_why():
    from embedscale.errors import ConfigError, EmbedscaleError

    def timer(name):
        if name == "b":
            raise EmbedscaleError("plan trial under b failed (exit 1): out of memory")
        return {"a": [0.05], "c": [0.04]}[name]

    plans = [{"name": n, "predicted_seconds": s} for n, s in (("a", 1.0), ("b", 1.01), ("c", 1.02))]
    out = measured_choice(plans, 0.10, timer)
    assert out["chosen"] == "c"  # b never measured (it would be the model's second), c the fastest measured
    b = next(c for c in out["candidates"] if c["name"] == "b")
    assert "out of memory" in b["error"] and "measured_median_seconds" not in b

    def broken(name):
        raise EmbedscaleError(f"{name} failed")

    with pytest.raises(ConfigError, match="no candidate ran: a: a failed; b: b failed; c: c failed"):
        measured_choice(plans, 0.10, broken)


class Launches:
    """A fake timer whose every plan gives a list of timings, one per launch in turn (a launch's drift)."""

    def __init__(self, timings):
        self.timings, self.calls = {k: list(v) for k, v in timings.items()}, []

    def __call__(self, name):
        self.calls.append(name)
        return [self.timings[name].pop(0)]


def test_a_second_round_retimes_the_close_plans_in_reverse_and_keeps_the_least_median():
    """Worked by hand, margin 15%: round 1 times a 84, b 75, c 77, d 95 ms (d is 27% over the best: out).
    Round 2 times c, b, a again in that order (within 86.25 ms): c 70, b 88, a 72. Medians of two: a 78, b 81.5,
    c 73.5: c is kept, though b was the fastest of round 1; d keeps its one timing."""
    t = Launches({"a": [0.084, 0.072], "b": [0.075, 0.088], "c": [0.077, 0.070], "d": [0.095]})
    plans = [{"name": n, "predicted_seconds": s} for n, s in (("a", 1.00), ("b", 1.01), ("c", 1.02), ("d", 1.03))]
    out = measured_choice(plans, 0.10, t, limit=4, rounds=2)
    assert t.calls == ["a", "b", "c", "d", "c", "b", "a"]
    assert out["chosen"] == "c" and out["rounds"] == 2
    got = {c["name"]: (c["measured_median_seconds"], c["steps_timed"]) for c in out["candidates"]}
    assert got == {"a": (pytest.approx(0.078), 2), "b": (pytest.approx(0.0815), 2), "c": (pytest.approx(0.0735), 2),
                   "d": (pytest.approx(0.095), 1)}
    # one round: the first timings decide (b)
    one = measured_choice(plans, 0.10, Launches({"a": [0.084], "b": [0.075], "c": [0.077], "d": [0.095]}), limit=4)
    assert one["chosen"] == "b" and one["rounds"] == 1


def test_a_clear_first_round_winner_stops_the_race():
    """Round 1: a 50 ms, b 80 ms (60% over): nothing is within 15% of a but a itself, so no second round."""
    t = Launches({"a": [0.05], "b": [0.08]})
    plans = [{"name": n, "predicted_seconds": s} for n, s in (("a", 1.0), ("b", 1.05))]
    out = measured_choice(plans, 0.10, t, rounds=3)
    assert t.calls == ["a", "b"] and out["chosen"] == "a" and out["rounds"] == 1


def test_a_plan_that_fails_in_a_later_round_is_not_chosen():
    from embedscale.errors import EmbedscaleError

    calls = []

    def timer(name):
        calls.append(name)
        if name == "a" and calls.count("a") == 2:
            raise EmbedscaleError("plan trial under a failed (exit 1)")
        return {"a": [0.040], "b": [0.045]}[name]

    plans = [{"name": n, "predicted_seconds": s} for n, s in (("a", 1.0), ("b", 1.01))]
    out = measured_choice(plans, 0.10, timer, rounds=2)
    assert calls == ["a", "b", "b", "a"] and out["chosen"] == "b"
    a = next(c for c in out["candidates"] if c["name"] == "a")
    assert "failed" in a["error"] and "measured_median_seconds" not in a


def test_the_explain_text_names_each_plans_timings():
    from embedscale.plan.auto_report import _trial_lines

    t = Launches({"a": [0.084, 0.072], "b": [0.075, 0.088], "c": [0.077, 0.070], "d": [0.095]})
    plans = [{"name": n, "predicted_seconds": s} for n, s in (("a", 0.08), ("b", 0.081), ("c", 0.082), ("d", 0.083))]
    lines = _trial_lines(measured_choice(plans, 0.10, t, limit=4, rounds=2))
    assert lines[0].startswith("measured choice (margin 10% of the step): kept 'c' after ") and lines[0].endswith(
        ", 2 rounds")
    assert lines[3].startswith("  c: predicted 82.0 ms, measured 73.5 ms (median of 77.0, 70.0) (error +12%")
    assert lines[4].startswith("  d: predicted 83.0 ms, measured 95.0 ms (error -13%")


def test_the_runs_trial_takes_its_rounds_from_the_config(tmp_path, monkeypatch):
    """``dist.plan_trial_rounds`` reaches the run's trial: two candidates 1% apart in their first launches are timed
    again in reverse order with rounds 2 (the second launches reverse them: 60 against 40 ms), once with rounds 1;
    each candidate's steps timed are the steady steps of all its launches."""
    from embedscale.specs import RunConfig
    from embedscale.train import plan_trial

    tabs = [TableSpec("big", 2_000_000, 16), TableSpec("mid", 300_000, 16), TableSpec("small", 5_000, 16)]
    prof = ZipfProfile.from_tables(tabs, alpha=0.9, samples=1_000_000)
    topo = Topology(ranks_per_host=2)
    plan = make_auto_plan(tabs, prof, topo, device_memory=24 * 2**20, host_memory=256 * 2**20, batch_size=1024,
                          other_budgets=False, hot_row_touch=0.0)
    n = len(trial_plans(plan_trial.candidate_plans(plan.meta["auto"]), 5.0)[0])
    assert n >= 2
    for rounds, want_calls in ((1, n), (2, n + 2)):
        launches = {"0": [0.0500, 0.0600], "1": [0.0505, 0.0400]}  # the others 1 s: out of the race
        seen = []

        def fake_time(cfg, plan_dir, run_dir, steps):
            name = plan_dir.parent.name
            seen.append(name)
            return (launches[name].pop(0) if name in launches else 1.0), 7

        monkeypatch.setattr(plan_trial, "_time", fake_time)
        cfg = RunConfig()
        cfg.dist.nproc, cfg.dist.plan_trial_steps, cfg.train.batch_size = 2, 5, 2048
        cfg.dist.plan_trial_rounds = rounds
        out = plan_trial.choose_by_trial(cfg, plan, None, tabs, prof, topo, tmp_path / f"plan{rounds}", False,
                                         {"prediction_error": 5.0})
        mc = out.meta["auto"]["measured_choice"]
        assert len(seen) == want_calls and mc["rounds"] == rounds
        if rounds == 2:
            assert seen[n:] == ["1", "0"]  # the close two again, in reverse order
            assert mc["chosen"] == mc["candidates"][1]["name"]  # median 45.25 ms against 55 ms
            assert [c["steps_timed"] for c in mc["candidates"][:2]] == [14, 14]
        else:
            assert mc["chosen"] == mc["candidates"][0]["name"]
