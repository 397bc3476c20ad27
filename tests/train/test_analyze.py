"""The alignment study: exact rates on constructed cases, pooling, the bootstrap CI, determinism of a real run."""

import json
import re

import pytest

from megatron_pdm.train.analyze import RULES, bootstrap_ci, summarize
from tests.helpers import ROOT, TRAIN_DENSE, init_checkpoint, one_line, train_cfg


def _rates(outside, disagree, ratio_kept, ratio_unsafe, pdm_kept, pdm_unsafe):
    return {"outside": outside, "disagree": disagree,
            "ratio_kept": ratio_kept, "ratio_unsafe_keep_rate": ratio_unsafe,
            "ratio_corrective_keep_rate": 1 - ratio_unsafe if ratio_kept else float("nan"),
            "pdm_kept": pdm_kept, "pdm_unsafe_keep_rate": pdm_unsafe,
            "pdm_corrective_keep_rate": 1 - pdm_unsafe if pdm_kept else float("nan")}


def test_summary_pools_kept_tokens_and_counts_seeds():
    seeds = []
    for r, p in ((0.5, 0.25), (0.4, 0.6), (0.3, 0.1)):
        seeds.append({k: _rates(10, 4, 4, r, 4, p) for k in ("topk_kl_aggregated", "topk_kl_uniform", "exact_kl")})
    seeds.append({k: _rates(3, 0, 0, float("nan"), 0, float("nan"))
                  for k in ("topk_kl_aggregated", "topk_kl_uniform", "exact_kl")})
    s = summarize(seeds)["topk_kl_aggregated"]
    assert s["ratio_unsafe_keep_rate"] == pytest.approx(0.4)  # (2 + 1.6 + 1.2) / 12
    assert s["pdm_unsafe_keep_rate"] == pytest.approx((1 + 2.4 + 0.4) / 12)
    assert s["ratio_corrective_keep_rate"] == pytest.approx(0.6)
    assert s["seeds_pdm_better"] == 2 and s["seeds_compared"] == 3
    assert s["outside_per_seed"] == pytest.approx(33 / 4)
    lo, hi = s["unsafe_diff_ratio_minus_pdm_ci95"]
    assert -0.2 <= lo <= hi <= 0.25


def test_bootstrap_ci_brackets_the_mean_and_is_deterministic():
    diffs = [0.1, 0.05, -0.02, 0.2, 0.0, float("nan")]
    lo, hi = bootstrap_ci(diffs)
    assert lo <= sum(diffs[:5]) / 5 <= hi
    assert bootstrap_ci(diffs) == (lo, hi)
    assert bootstrap_ci([0.3, 0.3, 0.3]) == (pytest.approx(0.3), pytest.approx(0.3))


def rank_analyze(group, cfg, out_dir, seeds, pre_updates):
    from megatron_pdm.train.analyze import run_analysis

    result = run_analysis(cfg, out_dir, seeds=seeds, rollouts=16, pre_updates=pre_updates)  # closes its groups
    return {k: v for k, v in result.items() if k != "seconds"}  # the wall time: the only thing that may differ


def test_real_study_is_deterministic_resumes_and_shares_rollouts(dist_pools, tmp_path):
    """Two seeds at pre-update counts (1, 2), twice: the same numbers. Stopped after one seed and run again for two,
    the study reads the finished seed back (a line a kill cut short ignored) and ends with the same result. The
    count 2 measured alone equals the count 2 measured after the count 1 on the same rollouts (the weights and the
    optimizer reset between counts)."""
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    cfg = train_cfg(TRAIN_DENSE, {"tensor": 2}, init, minibatches=1, micro_batch_size=8)
    run = lambda name, seeds, counts: dist_pools(2).run(  # noqa: E731
        rank_analyze, shared=(cfg, str(tmp_path / name), seeds, counts))[0]
    a = run("a", 2, (1, 2))
    run("b", 1, (1, 2))
    stored = tmp_path / "b" / "seeds.jsonl"
    rows = [json.loads(x) for x in stored.read_text().splitlines()]
    assert [(r["seed"], r["pre_updates"]) for r in rows] == [(0, 1), (0, 2)]
    rows[0]["reward"] = -1.0  # a mark: read back, not recomputed
    # and what a kill during seed 1's append would leave
    stored.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"seed": 1, "pre_updates": 1, "tok')
    b = run("b", 2, (1, 2))
    assert b["per_seed"][0]["reward"] == -1.0
    b["per_seed"][0]["reward"] = a["per_seed"][0]["reward"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert [json.loads(x)["seed"] for x in stored.read_text().splitlines()] == [0, 0, 1, 1]  # the cut line dropped
    assert [(s["seed"], s["pre_updates"]) for s in a["per_seed"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert a["summary"].keys() == {"1", "2"}
    alone = run("c", 1, (2,))
    assert json.dumps(alone["per_seed"][0], sort_keys=True) == json.dumps(a["per_seed"][1], sort_keys=True)
    for seed in a["per_seed"]:
        for kind, tail in RULES:
            key = "exact_kl" if kind == "kl" else f"{kind}_{tail}"
            r = seed[key]
            assert r["disagree"] <= r["outside"] <= seed["tokens"]
            assert r["ratio_kept"] + r["pdm_kept"] == r["disagree"]  # on disagreement tokens each rule keeps the rest
    assert (tmp_path / "a" / "analysis.png").stat().st_size > 1000
    assert json.loads((tmp_path / "a" / "analysis.json").read_text())["summary"].keys() == a["summary"].keys()


@pytest.mark.parametrize("override, named", [
    ("objective.correction=tis", "objective.correction = 'tis'"),
    ("objective.rejection=k1", "objective.rejection = 'k1'"),
    ("objective.veto_threshold=0.001", "objective.veto_threshold = 0.001"),
    ("objective.anchor=proximal", "objective.anchor = 'proximal'"),
    ("objective.kl_coef=0.1", "objective.kl_coef = 0.1"),
])
def test_cli_refuses_an_objective_the_study_cannot_measure(tmp_path, capsys, monkeypatch, override, named):
    """The study steps without pi_old or a reference: a setting whose loss needs them is one line naming the field
    and its value, before any process starts (the regression: `old_logprobs: required by ...` from the ranks, after
    the model was built and warm-started)."""
    from megatron_pdm.cli import main
    from megatron_pdm.train import launch

    def no_launch(*args, **kw):
        raise AssertionError("launched")

    monkeypatch.setattr(launch, "launch", no_launch)
    tiny = ["--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--out-dir", str(tmp_path / "a")]
    assert main(["analyze", *tiny, override]) == 2
    assert f"analyze: {named}: the analysis measures the loss without a step-start pass" in one_line(capsys,
                                                                                                      "analyze")
    assert not (tmp_path / "a").exists()


@pytest.mark.e2e
def test_cli_refuses_bad_input_in_one_line(tmp_path, capsys):
    """A bad value, or a layout the study cannot run (PP 2), is one line `analyze: <field>: ...` with exit code 2,
    before any process is spawned (the regression: a traceback, from the ranks for the layout)."""
    from megatron_pdm.cli import main

    tiny = ["--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--out-dir", str(tmp_path / "a")]
    assert main(["analyze", *tiny, "objective.mask=nope"]) == 2
    assert "analyze: objective.mask: 'nope' is not one of" in one_line(capsys, "analyze")
    assert main(["analyze", *tiny, "parallel.tensor=1", "parallel.pipeline=2"]) == 2
    assert "parallel: the analysis runs with data, pipeline and context parallelism 1" in one_line(capsys, "analyze")
    assert main(["analyze", *tiny, "--pre-updates", "1,1"]) == 2
    assert "analyze: --pre-updates: expected distinct integers >= 0" in one_line(capsys, "analyze")
    assert not (tmp_path / "a").exists()
    # a study of another setting in --out-dir is not resumed (nor overwritten)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "study.json").write_text(json.dumps({"rollouts": 256, "pre_updates": [1]}))
    assert main(["analyze", *tiny]) == 2
    assert "holds a study of another setting (config." in one_line(capsys, "analyze")


def test_study_identity_names_what_differs(tmp_path):
    """A resume may change what the study does not measure (steps, logging); anything else is refused, naming the
    key and both values."""
    from megatron_pdm.train.analyze import finished_seeds, study_identity
    from megatron_pdm.train.config import load_config

    tiny = ROOT / "examples" / "tiny_cpu.yaml"
    ident = study_identity(load_config(tiny), 64, (1, 2))
    (tmp_path / "study.json").write_text(json.dumps(ident))
    same = study_identity(load_config(tiny, ["train.steps=7", "logging.wandb=true"]), 64, (1, 2))
    assert finished_seeds(tmp_path, same) == {}  # nothing finished yet, and no refusal
    with pytest.raises(ValueError, match=r"another setting \(config.objective.delta: 0.15 there, 0.2 now\)"):
        finished_seeds(tmp_path, study_identity(load_config(tiny, ["objective.delta=0.2"]), 64, (1, 2)))
    with pytest.raises(ValueError, match=r"pre_updates: \[1, 2\] there, \[1\] now"):
        finished_seeds(tmp_path, study_identity(load_config(tiny), 64, (1,)))
    (tmp_path / "study.json").write_text('{"config.model')  # cut short
    with pytest.raises(ValueError, match=r"study.json is not valid JSON"):
        finished_seeds(tmp_path, ident)


def _no_launch(monkeypatch):
    from megatron_pdm.train import launch

    def no_launch(*args, **kw):
        raise AssertionError("launched")

    monkeypatch.setattr(launch, "launch", no_launch)


@pytest.mark.parametrize("rollouts", [4, 12, 0])
def test_rollouts_not_a_multiple_of_rollout_n_are_refused(tmp_path, capsys, monkeypatch, rollouts):
    """--rollouts below rollout.n (8 here) or not a multiple of it is one line naming --rollouts, its value and
    rollout.n, before any process starts; run_analysis refuses it too (the regression: it was rounded silently, to
    rollout.n responses for 4, to 8 for 12)."""
    from megatron_pdm.cli import main
    from megatron_pdm.train.analyze import run_analysis
    from megatron_pdm.train.config import load_config

    _no_launch(monkeypatch)
    tiny = ROOT / "examples" / "tiny_cpu.yaml"
    assert main(["analyze", "--config", str(tiny), "--out-dir", str(tmp_path / "a"), "--rollouts", str(rollouts)]) == 2
    assert (f"analyze: --rollouts: expected a multiple of rollout.n = 8 (rollouts / n prompts of n responses each), "
            f"got {rollouts}\n") == one_line(capsys, "analyze")
    with pytest.raises(ValueError, match=rf"^--rollouts: expected a multiple of rollout.n = 8 .*, got {rollouts}$"):
        run_analysis(load_config(tiny), tmp_path / "b", seeds=1, rollouts=rollouts)  # before any process group
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("study, seeds, named", [
    (b"null", None, r"study.json holds null, not a study's settings \(a JSON object\)"),
    (b"[1]", None, r"study.json holds \[1\], not a study's settings"),
    (b"\xff\xfe{}", None, r"study.json is not valid JSON \("),
    (None, b"[1]\n", r"seeds.jsonl:1: not a seed's row \(an object .*\): '\[1\]'"),
    (None, b'{"seed": 0, "pre_updates": 1}\n', r"seeds.jsonl:1: not a seed's row"),  # no estimator's rates
    (None, b'{"seed": 0, "pre_updates": 1, "topk_kl_aggregated": {}, "topk_kl_uniform": {}, "exact_kl": {}}\nnull\n',
     r"seeds.jsonl:2: not a seed's row .*: 'null'"),
])
def test_resume_files_that_are_json_but_not_the_study_are_one_line(tmp_path, capsys, monkeypatch, study, seeds,
                                                                     named):
    """A study.json that is JSON but not an object (or not UTF-8), or a seeds.jsonl row that is JSON but not a row
    the study wrote, is one line naming the file, before any process starts (the regression: an AttributeError or
    TypeError traceback)."""
    from megatron_pdm.cli import main
    from megatron_pdm.train.analyze import study_identity
    from megatron_pdm.train.config import load_config

    _no_launch(monkeypatch)
    tiny = ROOT / "examples" / "tiny_cpu.yaml"
    out = tmp_path / "a"
    out.mkdir()
    (out / "study.json").write_bytes(study or json.dumps(study_identity(load_config(tiny), 256, (1,))).encode())
    if seeds is not None:
        (out / "seeds.jsonl").write_bytes(seeds)
    assert main(["analyze", "--config", str(tiny), "--out-dir", str(out)]) == 2
    err = one_line(capsys, "analyze")
    assert re.search(named, err) and "remove the directory to start the study over" in err, err
