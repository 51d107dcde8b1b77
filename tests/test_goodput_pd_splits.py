"""The PD experiment: its splits (a grid of prefill shares, then the splits between each router's best and each of
its neighbours), and its runs, one per workload of the matrix with its own progress."""
import math

from bench import goodput
from bench.goodput import pd_extended_splits, pd_refined_splits, pd_shares, pd_splits
from cluster.sim.workload import workload_spec


def test_the_grid_covers_each_fleet_with_at_least_one_instance_on_each_side():
    for fluid_share in (0.05, 0.5, 0.96):
        for n in (2, 8, 16, 64):
            splits = pd_splits(n, pd_shares(fluid_share))
            assert splits == sorted(set(splits)) and 1 <= splits[0] and splits[-1] <= n - 1


def test_the_grid_lies_around_the_fluid_split_rounded_to_its_step():
    assert pd_shares(0.512) == pd_shares(0.489) == [0.375, 0.4375, 0.5, 0.5625, 0.625]
    assert pd_splits(64, pd_shares(0.512)) == [24, 28, 32, 36, 40]
    assert pd_splits(64, pd_shares(0.957)) == [52, 56, 60, 63]  # a prompt-heavy mix: toward all prefill
    assert pd_splits(16, pd_shares(0.2)) == [1, 2, 3, 4, 5]


def test_the_refined_splits_lie_between_the_best_and_each_neighbour():
    assert pd_refined_splits({24: 1.0, 28: 5.0, 32: 4.0, 36: 2.0}) == [26, 30]
    # the worse neighbour's side too: PolyServe-PD's peak at 64 lay between its best (32) and its worse neighbour
    assert pd_refined_splits({24: 1101.6, 28: 1252.1, 32: 1483.4, 36: 1288.0, 40: 1078.0}) == [30, 34]
    assert pd_refined_splits({24: 9.0, 28: 3.0, 32: 1.0}) == [26]  # the best at an edge: its one neighbour
    assert pd_refined_splits({28: 4.0, 32: 6.0, 36: 6.0}) == [30, 34]  # tied best: the fewer prefill
    assert pd_refined_splits({3: 1.0, 4: 2.0, 6: 1.0}) == [5]  # one instance apart on one side: nothing between
    assert pd_refined_splits({3: 1.0, 4: 2.0, 5: 1.0}) == [] and pd_refined_splits({4: 2.0}) == []


def _pd_run(workload: str, ours: float, theirs: float, co_located: float) -> dict:
    row = {"num_instances": 16, "polyserve_pd": ours, "polyserve_pd_prefill": 9, "best_pd_baseline": "mixed-deadline",
           "best_pd_baseline_goodput": theirs, "best_pd_baseline_prefill": 7, "co_located_polyserve": co_located,
           "ratio_to_best_pd_baseline": ours / theirs}
    return {"workload": workload, "link": "nvlink", "shares": [], "searches": [], "summary": [row]}


def test_the_pd_experiment_runs_on_every_workload_each_with_its_own_progress(tmp_path, monkeypatch, capsys):
    calls = []

    def run_pd(pool, plan, setup, progress):
        calls.append((setup.workload.name, progress.path.name, progress.key["workload"]))
        return _pd_run(setup.workload.name, 300.0, 250.0, 280.0)

    monkeypatch.setattr(goodput, "run_pd", run_pd)
    args = goodput.parse_args(["--experiments", "pd", "--workloads", "conv-4tier,code-4tier", "--out", str(tmp_path)])
    report = {}
    specs = [workload_spec("conv-4tier"), workload_spec("code-4tier")]
    goodput.run_experiments(None, goodput.make_plan(args), args, ["pd"], specs, report, {"code": "x"})
    assert calls == [("conv-4tier", "goodput_pd_progress_conv-4tier.json", "conv-4tier"),
                     ("code-4tier", "goodput_pd_progress_code-4tier.json", "code-4tier")]
    assert [run["workload"] for run in report["pd"]] == ["conv-4tier", "code-4tier"]
    table = [line for line in capsys.readouterr().out.splitlines() if "4tier" in line]
    assert len(table) == 2 and all("1.20x" in line and "1.07x" in line for line in table)


def test_a_printed_ratio_is_rounded_down():
    assert [goodput._ratio(x) for x in (1.2454, 1.25, 1.15, 0.999, math.nan)] == ["1.24x", "1.25x", "1.15x", "0.99x",
                                                                                  "-"]


def test_a_best_split_at_the_grids_edge_is_followed_a_step_beyond_it():
    assert pd_extended_splits({3: 1.0, 4: 2.0, 5: 3.0}, 8) == [6]  # rising to the top: one more prefill instance
    assert pd_extended_splits({24: 1.0, 28: 2.0, 32: 3.0, 36: 4.0, 40: 5.0}, 64) == [44]  # a grid step at 64
    assert pd_extended_splits({5: 1.0, 6: 2.0, 7: 3.0}, 8) == []  # one decode instance left: no room
    assert pd_extended_splits({24: 5.0, 28: 4.0, 32: 3.0}, 64) == [20]  # falling: fewer prefill
    assert pd_extended_splits({1: 5.0, 2: 4.0}, 8) == []
    assert pd_extended_splits({24: 1.0, 28: 5.0, 32: 2.0}, 64) == []  # the best inside the searched splits
    assert pd_extended_splits({4: 2.0}, 8) == []  # one split alone has no direction


def test_a_pd_search_keeps_each_tiers_attainment_at_its_goodput_from_its_own_run(monkeypatch):
    """As a matrix cell does: the first seed's run at the goodput found, under the three views, not simulated again."""
    simulated = []
    simulate = goodput._simulate

    def counted(*args, **kwargs):
        simulated.append(args[4:6])
        return simulate(*args, **kwargs)

    monkeypatch.setattr(goodput, "_simulate", counted)
    setup = goodput.Setup(workload_spec("conv-4tier"), None, 4.0, 4.0)
    bound = setup.bound(disaggregated=True).rate(4)
    found = goodput.SearchJob(setup, "polyserve", 4, 0, (1, 2), 0.3 * bound, 0.9 * bound, 0.25,
                              prefill_instances=1).run()
    assert found["goodput"] > 0 and len(simulated) == len(set(simulated)) == 2 * len(found["probes"])
    at = found["at_headline"]
    assert (at["rate"], at["seed"]) == (found["goodput"], 1)
    assert set(at["attainment"]) == set(goodput.VIEWS)
    assert all(set(shares) == {"tight", "snug", "relaxed", "loose"} for shares in at["attainment"].values())
    seed_1 = next(p[2][0] for p in found["probes"] if p[0] == found["goodput"])
    assert min(at["attainment"]["cumulative"].values()) == seed_1 >= 0.9


def test_the_fleet_size_scan_prints_each_tiers_attainment_at_each_goodput(monkeypatch, capsys):
    at = {"rate": 20.0, "seed": 1, "attainment": {view: {"tight": 0.91, "loose": 0.97} for view in goodput.VIEWS}}

    def run(job, map_fn=map, width=1):
        return {"policy": job.policy, "num_instances": job.num_instances, "goodput": 10.0 * job.num_instances,
                "at_headline": at}

    monkeypatch.setattr(goodput.SearchJob, "run", run)
    args = goodput.parse_args(["--experiments", "scan", "--scan-fleets", "2,4"])
    goodput.run_scan(None, goodput.make_plan(args), goodput.Setup(workload_spec("conv-4tier"), None, 4.0, 4.0),
                     ["polyserve"], (5.0, 20.0), 1)
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if "polyserve" in line and "/" in line]
    assert [line[:2] for line in lines] == [["2", "polyserve"], ["4", "polyserve"]]
    assert all(line[2:] == ["91", "97", "/"] * 2 + ["91", "97"] for line in lines)
