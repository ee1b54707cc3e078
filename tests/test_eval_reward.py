"""``eval-reward`` end to end: summary.json against a NumPy reference, valid PNGs, bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from matplotlib import image

from megatron_rlhf.reward.evaluate import main

PNGS = ("fig2_calibration.png", "fig3_score_hist.png", "fig4_task_scores.png")


def numpy_reference(chosen, rejected, bins=10):
    """Accuracy and ECE×100 (ties: wrong for accuracy, 1/2 for ECE), vectorised NumPy."""
    chosen, rejected = np.asarray(chosen), np.asarray(rejected)
    gap = chosen - rejected
    confidence = 1.0 / (1.0 + np.exp(-np.abs(gap)))
    correct = np.where(gap > 0, 1.0, np.where(gap < 0, 0.0, 0.5))
    index = np.minimum(np.floor((confidence - 0.5) * 2 * bins).astype(int), bins - 1)
    ece = sum(
        (index == b).mean() * abs(correct[index == b].mean() - confidence[index == b].mean())
        for b in range(bins)
        if (index == b).any()
    )
    return float((gap > 0).mean()), 100.0 * ece


def write_scores(path, seed=0, size=400):
    rng = np.random.default_rng(seed)
    tasks = rng.choice(["code", "qa", "chat"], size)
    offset = {"code": 2.0, "qa": -1.0, "chat": 0.0}
    chosen, rejected, task_of = [], [], []
    lines = []
    for i, task in enumerate(tasks):
        c = offset[task] + rng.normal(0.7, 1.5)
        r = c if i % 50 == 0 else offset[task] + rng.normal(0.0, 1.5)  # a few ties
        record = {"chosen_score": c, "rejected_score": r}
        if i % 7:  # every 7th pair has no task, or a null one
            record["task"] = str(task)
        elif i % 2:
            record["task"] = None
        chosen.append(c)
        rejected.append(r)
        task_of.append(record.get("task") or "untagged")
        lines.append(json.dumps(record))
        if i % 100 == 0:
            lines.append("")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n")
    return chosen, rejected, task_of


def test_summary_matches_reference(tmp_path, capsys):
    scores = tmp_path / "scores.jsonl"
    chosen, rejected, tasks = write_scores(scores)
    out = tmp_path / "eval"
    assert main(["--scores", str(scores), "--output-dir", str(out), "--label", "RM"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    ref_accuracy, ref_ece = numpy_reference(chosen, rejected)
    assert summary["num_pairs"] == len(chosen)
    assert summary["accuracy"] == pytest.approx(ref_accuracy, abs=1e-12)
    assert summary["ece"] == pytest.approx(ref_ece, abs=1e-9)
    assert summary["ties"] == sum(c == r for c, r in zip(chosen, rejected)) == 8
    assert sorted(summary["per_task"]) == ["chat", "code", "qa", "untagged"]
    for task, row in summary["per_task"].items():
        rows = [i for i, t in enumerate(tasks) if t == task]
        scores_of_task = np.array([chosen[i] for i in rows] + [rejected[i] for i in rows])
        assert row["mean"] == pytest.approx(scores_of_task.mean(), abs=1e-12)
        assert row["std"] == pytest.approx(scores_of_task.std(ddof=0), abs=1e-12)
        assert row["count"] == 2 * len(rows)
    assert sum(row["count"] for row in summary["calibration_bins"]) == len(chosen)
    for name in PNGS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert image.imread(out / name).shape[0] > 100  # decodes to a real picture
    markdown = (out / "summary.md").read_text()
    assert f"{100 * ref_accuracy:.2f} %" in markdown and "| code |" in markdown
    assert sorted(p.name for p in out.iterdir()) == sorted([*PNGS, "summary.json", "summary.md"])
    assert "[eval-reward] done:" in capsys.readouterr().out


@pytest.mark.launch
def test_cli_through_python_dash_m(tmp_path):
    scores = tmp_path / "s.jsonl"
    write_scores(scores, seed=1, size=60)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rlhf", "eval-reward", "--scores", str(scores)]
        + ["--output-dir", str(tmp_path / "out"), "--bins", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert len(summary["calibration_bins"]) == 5
    assert f"pairs={summary['num_pairs']}" in proc.stdout


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"chosen_score": NaN, "rejected_score": 0.1}', "s.jsonl:3: chosen_score"),
        ('{"chosen_score": 1.0, "rejected_score": Infinity}', "s.jsonl:3: rejected_score"),
        ('{"chosen_score": "high", "rejected_score": 0.1}', "s.jsonl:3: chosen_score"),
        ('{"chosen_score": true, "rejected_score": 0.1}', "s.jsonl:3: chosen_score"),
        ('{"chosen_score": 1.0}', "s.jsonl:3: missing 'rejected_score'"),
        ('{"chosen_score": 1.0, "rejected_score": 0.0, "task": 3}', "s.jsonl:3: task"),
        ('{"chosen_score": 1.0, "rejected_score": ', "s.jsonl:3: malformed JSON"),
        ("[1.0, 0.0]", "s.jsonl:3: expected a JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, capsys, line, message):
    scores = tmp_path / "s.jsonl"
    good = '{"chosen_score": 1.0, "rejected_score": 0.5, "task": "qa"}'
    scores.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    out = tmp_path / "out"
    assert main(["--scores", str(scores), "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not (out / "summary.json").exists()


def test_empty_missing_file_and_bad_bins(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(["--scores", str(empty), "--output-dir", str(tmp_path / "o")]) == 2
    assert "empty.jsonl: no score pairs" in capsys.readouterr().err
    assert main(["--scores", str(tmp_path / "nope.jsonl"), "--output-dir", "x"]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    empty.write_text('{"chosen_score": 1.0, "rejected_score": 0.5}\n')
    assert main(["--scores", str(empty), "--output-dir", str(tmp_path / "o"), "--bins", "0"]) == 2
    assert "--bins must be >= 1" in capsys.readouterr().err


def test_plots_compare_several_models(tmp_path):
    """RM and AM in one figure each, as in the paper; a task may be missing for one model."""
    from megatron_rlhf.reward import calibration, plots

    rng = np.random.default_rng(3)
    chosen, rejected = rng.normal(1, 2, 50), rng.normal(0, 2, 50)
    tasks = ["a"] * 25 + ["b"] * 25
    stats = calibration.per_task_stats(chosen, rejected, tasks)
    curve = calibration.reliability_curve(chosen, rejected)
    plots.plot_calibration(tmp_path / "f2.png", {"RM": curve, "AM": curve[:3]})
    plots.plot_score_histograms(
        tmp_path / "f3.png", {"RM": (chosen, rejected), "AM": (rejected, chosen)}
    )
    plots.plot_task_stats(tmp_path / "f4.png", {"RM": stats, "AM": {"a": stats["a"]}})
    for name in ("f2.png", "f3.png", "f4.png"):
        picture = image.imread(tmp_path / name)
        assert picture.ndim == 3 and picture.shape[1] > picture.shape[0] * 0.9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f2.png", "f3.png", "f4.png"]
