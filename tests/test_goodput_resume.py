"""A goodput matrix stopped part way and resumed gives what the whole run gives, running only what was left; the
report checkpointed part way is plotted."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

import bench.goodput
from bench.goodput import (JobProgress, cell_jobs, main, make_plan, matrix_report, matrix_workloads, parse_args,
                           run_matrix, write_plots)
from cluster.sim.workload import workload_spec

WORKLOAD = "conv-2tier"
# the committed progress of a whole matrix, which the merge tests take as the earlier run
WHOLE_MATRIX_PROGRESS = Path(__file__).resolve().parent.parent / "bench" / "results" / "goodput_progress.json"


def _plan():
    args = parse_args(["--quick", "--workloads", WORKLOAD, "--policies", "polyserve,mixed-deadline", "--fleets", "2,4",
                       "--leader-fleets", "", "--seeds", "1", "--rel-tol", "0.3", "--processes", "1"])
    # a short window on tiny fleets: the figures are not the point, only that they come out the same
    return replace(make_plan(args), warmup_s=2.0, window_s=2.0, window_instance_s=0.0)


def _run(plan, progress: JobProgress, checkpoint=lambda workloads, cells: None) -> list[dict]:
    workloads = matrix_workloads([workload_spec(WORKLOAD)], plan, None, "exact")
    cells, sweep = run_matrix(None, plan, workloads, None, lambda cells, sweep: checkpoint(workloads, cells), progress)
    assert sweep == []
    return cells


def _figures(cell: dict) -> list:
    return json.loads(json.dumps([cell["headline"]["goodput"], cell["strict"]["goodput"], cell["headline"]["probes"],
                                  cell["strict"]["probes"]]))


def _by_key(cells: list[dict]) -> dict[str, dict]:
    return {f"cell|{c['workload']}|{c['policy']}|{c['num_instances']}": c for c in cells}


def test_a_resumed_matrix_runs_only_what_was_left_and_gives_the_whole_runs_figures(tmp_path):
    plan = _plan()
    key = {"plan": asdict(plan)}
    path = tmp_path / "progress.json"
    whole = _by_key(_run(plan, JobProgress.open(path, key, resume=False)))
    assert len(whole) == 4  # two policies at two fleet sizes
    saved = json.loads(path.read_text())["results"]
    assert saved.keys() == whole.keys()

    # stopped with one cell of the larger fleet left; the other one marked, to tell a kept result from a rerun
    left = f"cell|{WORKLOAD}|mixed-deadline|4"
    marked = f"cell|{WORKLOAD}|polyserve|4"
    kept = {k: v for k, v in saved.items() if k != left}
    kept[marked]["headline"]["goodput"] = 12345.0
    path.write_text(json.dumps({"key": json.loads(path.read_text())["key"], "results": kept}))
    resumed = _by_key(_run(plan, JobProgress.open(path, key, resume=True)))

    assert resumed[marked]["headline"]["goodput"] == 12345.0  # taken as it was kept, not run again
    for k in whole:
        if k != marked:  # the one left ran again from the same smaller fleet's figures: the whole run's figures
            assert _figures(resumed[k]) == _figures(whole[k]), k
    assert json.loads(path.read_text())["results"].keys() == whole.keys()


def test_a_cell_cut_short_goes_on_from_the_runs_its_journal_kept(tmp_path, monkeypatch):
    """A matrix cell stopped part way (here: its journal cut after some runs, the last line half written) runs only
    the simulations it had not finished and gives the figures of the whole cell."""
    plan = _plan()
    workloads = matrix_workloads([workload_spec(WORKLOAD)], plan, None, "exact")
    job = replace(cell_jobs(plan, workloads[0], [], 2, ["polyserve"], plan.rel_tol)[0], journal=tmp_path / "j.jsonl")
    simulated = []
    simulate = bench.goodput._simulate
    monkeypatch.setattr(bench.goodput, "_simulate", lambda *a, **k: simulated.append(a[4:6]) or simulate(*a, **k))
    whole = job.run()
    lines = job.journal.read_text().splitlines(keepends=True)
    assert len(lines) == len(simulated) == whole["simulations"] >= 4  # both rules' searches, every run once
    assert {json.loads(x)["fleet"] for x in lines} == {"every-tier", "strict"}

    kept = 3
    job.journal.write_text("".join(lines[:kept]) + lines[kept][:20])
    first_runs, simulated[:] = list(simulated), []
    started = time.perf_counter()
    resumed = job.run()
    elapsed = time.perf_counter() - started
    assert simulated == first_runs[kept:]  # the rest, in the same order: the searches took the same path
    assert _figures(resumed) == _figures(whole) and resumed["at_headline"] == whole["at_headline"]
    assert len(job.journal.read_text().splitlines()) == len(lines)  # the half line dropped, the rest appended
    # its wall time: what the kept runs took when they ran, and this sitting's (its runs and the searches around them)
    earlier_s, new_s = (sum(json.loads(x)["wall_s"] for x in part)
                        for part in (lines[:kept], job.journal.read_text().splitlines()[kept:]))
    assert earlier_s > 0 and earlier_s + new_s <= resumed["wall_s"] <= earlier_s + elapsed


def test_a_fresh_run_drops_the_journals_of_another_and_a_finished_cell_drops_its_own(tmp_path):
    plan = _plan()
    path = tmp_path / "progress.json"
    stale = JobProgress(path, {}).runs_dir / f"cell_{WORKLOAD}_polyserve_2.jsonl"
    stale.parent.mkdir()
    stale.write_text('{"fleet": "every-tier", "rate": 1.0, "seed": 1, "kept": {"pooled": 1.0}}\n')
    progress = JobProgress.open(path, {"plan": asdict(plan)}, resume=False)
    assert not stale.exists() and json.loads(path.read_text())["results"] == {}  # the key is on file at once
    assert JobProgress.open(path, {"plan": asdict(plan)}, resume=True).results == {}
    _run(plan, progress)
    assert list(progress.runs_dir.iterdir()) == []


def test_progress_of_another_plan_is_not_resumed(tmp_path):
    plan = _plan()
    path = tmp_path / "progress.json"
    path.write_text(json.dumps({"key": {"plan": asdict(replace(plan, rel_tol=0.2))}, "results": {}}))
    with pytest.raises(SystemExit, match="plan"):
        JobProgress.open(path, {"plan": asdict(plan)}, resume=True)
    # without resume it starts afresh whatever the file holds
    assert JobProgress.open(path, {"plan": asdict(plan)}, resume=False).results == {}


def test_a_report_checkpointed_before_the_largest_fleet_ran_is_plotted(tmp_path):
    plan = _plan()
    plotted = []

    def checkpoint(workloads, cells):
        out = tmp_path / f"round{len(plotted)}"
        report = {"matrix": matrix_report(workloads, cells, [], plan, "exact", None)}
        write_plots(report, out)
        plotted.append((sorted({c["num_instances"] for c in cells}), sorted(p.name for p in out.iterdir())))

    _run(plan, JobProgress.open(tmp_path / "progress.json", {"plan": asdict(plan)}, resume=False), checkpoint)
    figures = ["goodput_ratio_heatmap.png", "tier_attainment_at_goodput.png"]
    assert plotted == [([2], figures), ([2, 4], figures)]  # the first after the smaller fleet alone
    assert all((tmp_path / "round0" / name).read_bytes().startswith(b"\x89PNG") for name in figures)


def test_a_matrix_merged_from_kept_progress_takes_each_cell_from_the_last_file_that_holds_it(tmp_path, capsys):
    """`--merge`: the matrix of the cells kept by earlier runs (here the committed progress of a whole matrix, and a
    rerun of one cell), the rerun's replacing the first's, each recorded with the file and code it came from."""
    whole = WHOLE_MATRIX_PROGRESS
    saved = json.loads(whole.read_text())
    key = "cell|conv-4tier|polyserve|64"
    rerun = {"key": {**saved["key"], "code": "rerun"}, "results": {key: json.loads(json.dumps(saved["results"][key]))}}
    rerun["results"][key]["headline"]["goodput"] *= 2
    (tmp_path / "rerun.json").write_text(json.dumps(rerun))
    main(["--merge", f"{whole},{tmp_path / 'rerun.json'}", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "goodput.json").read_text())
    cells = {(c["workload"], c["policy"], c["num_instances"]): c for c in report["matrix"]["cells"]}
    assert len(cells) == len([k for k in saved["results"] if k.startswith("cell|")])
    doubled = cells[("conv-4tier", "polyserve", 64)]["headline"]
    assert doubled["goodput"] == pytest.approx(2 * saved["results"][key]["headline"]["goodput"], rel=1e-3)
    assert doubled["vs_best"] > 2.0  # its ratio is taken anew against the first file's baselines
    assert report["merged_from"][key]["code"] == "rerun"
    assert report["merged_from"]["cell|conv-4tier|polyserve|16"]["code"] == saved["key"]["code"]
    assert (tmp_path / "out" / "goodput_ratio_heatmap.png").exists() and "conv-4tier" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="matrix only"):
        main(["--merge", str(whole), "--experiments", "pd", "--out", str(tmp_path / "out")])


def test_a_merged_matrix_takes_its_error_sweep_whole_from_the_last_file_that_holds_one(tmp_path):
    """A rerun's sweep, its rates shares of another bound, replaces the first file's sweep rather than interleaving
    with it: every run of the merged sweep is the rerun's, and the sweep prints."""
    whole = WHOLE_MATRIX_PROGRESS
    saved = json.loads(whole.read_text())
    old_sweep = {k: r for k, r in saved["results"].items() if k.startswith("sweep|")}
    assert old_sweep
    # another grid: none of the first file's rates
    rerun = {f"{key}|rerun": {**run, "rate": run["rate"] * 1.09} for key, run in old_sweep.items()}
    (tmp_path / "rerun.json").write_text(json.dumps({"key": {**saved["key"], "code": "rerun"}, "results": rerun}))
    main(["--merge", f"{whole},{tmp_path / 'rerun.json'}", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "goodput.json").read_text())
    runs = report["matrix"]["sweep"]["runs"]
    assert sorted(r["rate"] for r in runs) == pytest.approx(sorted(r["rate"] for r in rerun.values()), rel=1e-4)
    assert all(report["merged_from"][key]["code"] == "rerun" for key in rerun)
    assert not any(key in report["merged_from"] for key in old_sweep)


def test_a_merged_leader_cell_names_the_larger_fleets_best_baseline_it_was_not_compared_with(tmp_path, capsys):
    """A matrix merged from runs whose leaders differ: where the best baseline at the largest fleet (here one made
    the best by a rerun) was not run at a leader fleet, PolyServe's cell there says so, in the report and the
    printed summary, rather than passing off the ratio against the one baseline that ran."""
    whole = WHOLE_MATRIX_PROGRESS
    saved = json.loads(whole.read_text())
    at_256 = {k.split("|")[2] for k in saved["results"] if k.startswith("cell|conv-4tier|") and k.endswith("|256")}
    assert at_256 == {"polyserve", "mixed-deadline"}  # the leaders of the run that made the file
    key = "cell|conv-4tier|mixed-deadline-admission|64"
    rerun = {"key": {**saved["key"], "code": "rerun"}, "results": {key: json.loads(json.dumps(saved["results"][key]))}}
    rerun["results"][key]["headline"]["goodput"] *= 3  # now the best baseline at 64
    (tmp_path / "rerun.json").write_text(json.dumps(rerun))

    def polyserve_at_256(paths: str) -> dict:
        main(["--merge", paths, "--out", str(tmp_path / "out")])
        report = json.loads((tmp_path / "out" / "goodput.json").read_text())
        return next(c for c in report["matrix"]["cells"] if c["workload"] == "conv-4tier"
                    and c["policy"] == "polyserve" and c["num_instances"] == 256)

    cell = polyserve_at_256(str(whole))
    assert cell["headline"]["leader_not_run"] is None and cell["strict"]["leader_not_run"] is None
    capsys.readouterr()
    cell = polyserve_at_256(f"{whole},{tmp_path / 'rerun.json'}")
    assert cell["headline"]["leader_not_run"] == "mixed-deadline-admission"
    assert cell["headline"]["best_baseline"] == "mixed-deadline"  # the ratio is still the one that can be taken
    assert cell["strict"]["leader_not_run"] is None  # the rerun left the strict leader at 64 as it was
    assert "conv-4tier at 256, headline: mixed-deadline-admission" in capsys.readouterr().out
