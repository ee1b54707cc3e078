"""The study's task machinery, in-process and without training: worlds and seeds, the task
graph of each part, a stopped run's resume (done tasks kept, unfinished ones started again
from an empty directory, refused from other code), the task results' JSON form (paths kept
inside the run), and the family-stratified D_R."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_rlhf.study import run, stages, world
from megatron_rlhf.study.presets import PRESETS, world_of
from megatron_rlhf.utils import InputError, write_jsonl


def test_seeds_are_spread_over_worlds_and_every_task_needs_its_world():
    preset = replace(PRESETS["full"], seeds=7, worlds=3, first_seed=100, attribution_seeds=4,
                     curve_seeds=2, exploratory_seeds=1, sweep_seeds=0, extra_reward_seeds=0)  # fmt: skip
    assert [world_of(preset, s) for s in range(100, 107)] == [0, 1, 2, 0, 1, 2, 0]
    tasks = run.study_tasks(preset)
    assert [t for t in tasks if t[0] == "world"] == [("world", w, "") for w in range(3)]
    order = list(tasks)
    for task, needs in tasks.items():
        for need in needs:
            assert order.index(need) < order.index(task), (task, need)
        if task[0] != "world":
            assert ("world", world_of(preset, task[1]), "") in needs, task
    attribution = {seed for kind, seed, name in tasks if name == "am_ppo_strat_g0.1"}
    assert attribution == {100, 101, 102, 103}  # the first 4 seeds: every world has one
    curves = {(seed, name) for kind, seed, name in tasks if kind == "curve"}
    assert curves == {(s, r) for s in (100, 101) for r in ("rm_ppo_curve", "am_ppo_curve")}
    arms = run.attribution_arms(preset)
    assert arms["am_ppo_kl"] == ("am", {"ppo": {"kl_coef": preset.kl_matched_coefs[0]}})
    assert arms["am_ppo_strat_g0.1"][1]["rehearsal"] == "strat"
    several = run.attribution_arms(replace(preset, kl_matched_coefs=(0.05, 0.1)))
    assert {"am_ppo_kl0.05", "am_ppo_kl0.1"} <= set(several) and "am_ppo_kl" not in several
    assert run.part_of(("arm", 100, "am_ppo_kl"), preset) == "attribution"
    assert run.part_of(("arm", 100, "am_ppo_sr_gold"), preset) == "core"
    assert run.part_of(("arm", 100, "rm_ppo_sr"), preset) == "exploratory"
    with pytest.raises(ValueError, match="not an arm"):
        run.part_of(("arm", 100, "am_ppo_sr_g7"), preset)


def _part_by_prefix(task) -> str:
    """``part_of`` as it was, by name prefixes: the reference its arms' parts are held to."""
    kind, _, name = task
    if kind in ("world", "curve"):
        return {"world": "worlds", "curve": "curves"}[kind]
    if kind == "reward":
        return "core" if name in ("rm", "am") else "extra_rewards"
    if kind == "curation" or name in run.ARMS:
        return "core"
    if name.startswith("am_ppo_sr_c"):
        return "sweep"
    if name.startswith(("am_ppo_kl", "am_ppo_sr_g", "am_ppo_rr_g", "am_ppo_strat_g",
                        "am_ppo_sft_g")):  # fmt: skip
        return "attribution"
    return "exploratory"


@pytest.mark.parametrize("name", ["quick", "full", "grid"])
def test_every_task_has_the_part_of_the_function_that_names_it(name):
    """``part_of`` reads an arm's part off the functions that define the arms, and gives every
    task of a study the part the name prefixes gave (several KL-matched arms, the PPO grid and
    the sweep included); ``part_seconds`` sums over the parts."""
    preset = PRESETS["quick" if name == "quick" else "full"]
    if name == "grid":
        preset = replace(preset, kl_matched_coefs=(0.05, 0.1), gammas=(0.3, 1.0),
                         ppo_grid=({"actor_lr": 3e-4}, {"steps": 10}))  # fmt: skip
    tasks = run.study_tasks(preset)
    parts = {task: run.part_of(task, preset) for task in tasks}
    assert parts == {task: _part_by_prefix(task) for task in tasks}
    assert {"worlds", "core", "exploratory", "attribution", "curves", "sweep"} <= set(
        parts.values()
    )
    totals = run.part_seconds(dict.fromkeys(tasks, 1.0), preset)
    assert totals == {part: float(list(parts.values()).count(part)) for part in totals}


def test_cli_refuses_more_worlds_than_seeds_and_bad_counts(tmp_path, capsys):
    for argv, says in ((["--seeds", "2", "--worlds", "3"], "every world needs a seed"),
                       (["--worlds", "0"], "--worlds"), (["--curve-seeds", "-1"], "--curve-seeds"),
                       (["--kl-matched-coef", "0"], "--kl-matched-coef")):  # fmt: skip
        out = tmp_path / "never"
        assert run.main(["--output-dir", str(out), *argv]) == 2
        assert says in capsys.readouterr().err and not out.exists()


def test_task_results_round_trip_as_json_and_stay_inside_the_run(tmp_path):
    out = tmp_path / "run"
    value = {"main": out / "rehearsal" / "d_r", (4, 8): out / "x", "n": [1, (2, "a")]}
    assert run.from_json(out, json.loads(json.dumps(run.to_json(out, value)))) == value
    with pytest.raises(InputError, match="outside the run"):
        run.from_json(out, {"path": "../../etc/passwd"})
    with pytest.raises(InputError, match="unknown object"):
        run.from_json(out, {"code": "print(1)"})


def _counting_runner(calls):
    def runner(shared, task, inputs):
        calls.append(task)
        return run.run_task(shared, task, inputs)

    return runner


def test_a_done_task_is_kept_and_an_unfinished_one_starts_again_from_empty(tmp_path, monkeypatch):
    """``run_task`` reads a done task's result back without running it, and removes what an
    unfinished task left before running it again."""
    out = tmp_path / "run"
    preset = PRESETS["quick"]
    shared = run.Shared(out=out, preset=preset, started=0.0)
    ran = []

    def fake_reward_stage(out_, preset_, home, seed, name):
        run_dir = out_ / "reward" / name / f"seed{seed}"
        assert not run_dir.exists()  # starts from an empty directory
        run_dir.mkdir(parents=True)
        ran.append((seed, name))
        return run_dir / "step_0000001"

    monkeypatch.setattr(run, "reward_stage", fake_reward_stage)
    task, home = ("reward", 0, "rm"), ("world", 0, "")
    result, _ = run.run_task(shared, task, {home: {}})
    assert result == out / "reward" / "rm" / "seed0" / "step_0000001" and ran == [(0, "rm")]
    again, seconds = run.run_task(shared, task, {home: {}})
    assert again == result and seconds == 0.0 and ran == [(0, "rm")]  # kept, not run
    unfinished = out / "reward" / "am" / "seed0"
    unfinished.mkdir(parents=True)
    (unfinished / "half_written").write_text("x")
    run.run_task(shared, ("reward", 0, "am"), {home: {}})
    assert ran[-1] == (0, "am") and not (unfinished / "half_written").exists()


def test_resume_reads_the_runs_settings_and_refuses_other_code(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with pytest.raises(InputError, match="no such file"):
        run.resume_settings(out)
    out.mkdir()
    preset = replace(PRESETS["quick"], seeds=2, first_world=7)
    saved = {"preset_name": "quick", "preset": json.loads(json.dumps(run.asdict(preset))),
             "started_utc": "2026-12-05T00:00:00+00:00", "git_commit": "abc", "git_dirty": False}  # fmt: skip
    (out / run.RUN_FILE).write_text(json.dumps(saved))
    here = {"started_utc": "now", "git_commit": "abc", "git_dirty": False}
    monkeypatch.setattr(run, "code_provenance", lambda started, root=None: dict(here))
    assert run.resume_settings(out) == (out, preset, "quick")  # tuples come back as tuples
    for change in ({"git_commit": "def"}, {"git_dirty": True}):
        here.update({"git_commit": "abc", "git_dirty": False, **change})
        with pytest.raises(InputError, match="one clean commit"):
            run.resume_settings(out)
    here.update({"git_commit": "abc", "git_dirty": False})
    (out / run.RUN_FILE).write_text(json.dumps({**saved, "git_dirty": True}))
    with pytest.raises(InputError, match="one clean commit"):
        run.resume_settings(out)
    assert run.main(["--resume", "--output-dir", str(out), "--overwrite"]) == 2


def test_stratified_rehearsal_holds_every_minor_skill_and_the_top_of_each_family(tmp_path):
    """Each minor skill gets its top ``per_minor`` by the AM's score, the preference families
    share the rest by their PPO share; the builder keeps exactly those records."""
    import random

    rng = random.Random(0)
    prompts = world.split_prompts({"p": dict.fromkeys(world.TASK_SPECS, 12)}, seed=3)["p"]
    rows = [{"prompt": r["prompt"], "response": world.response_text(r["prompt"], rng,
                                                                     world.SFT_STYLE),
             "score": rng.gauss(0.0, 1.0)} for r in prompts]  # fmt: skip
    scored = tmp_path / "scored.jsonl"
    write_jsonl(scored, rows)
    tokenizer = stages.build_tokenizer([r["prompt"] + r["response"] for r in rows],
                                       tmp_path / "tok", 400)  # fmt: skip
    prefix = stages.stratified_rehearsal(scored, tokenizer, tmp_path / "strat", 32, 4, seed=0)
    chosen = stages.read_records(Path(f"{prefix}.selected.jsonl"))
    by_task = {}
    for r in chosen:
        by_task.setdefault(world.task_of(r["prompt"]), []).append(r["score"])
    assert sum(map(len, by_task.values())) == 32
    for task in world.MINOR_TASKS:
        assert len(by_task[task]) == 4, task
    for task, scores in by_task.items():
        pool = sorted((r["score"] for r in rows if world.task_of(r["prompt"]) == task),
                      reverse=True)  # fmt: skip
        assert sorted(scores, reverse=True) == pytest.approx(pool[: len(scores)]), task
    rest = {task: len(by_task[task]) for task in world.PREFERENCE_TASKS}
    assert sum(rest.values()) == 32 - 4 * len(world.MINOR_TASKS)
    assert rest["qa"] >= rest["code"] >= rest["chat"] >= 1


def test_minor_skills_are_read_off_a_runs_recorded_data_when_it_did_not_record_them():
    families = {"ppo_prompts": {t: 1 for t in world.TASK_SPECS},
                "pref_train": {t: 1 for t in world.PREFERENCE_TASKS}}  # fmt: skip
    settings = {"data": [{"families": families}, {"families": families}]}
    assert run.with_minor_skills(settings)["minor_skills"] == list(world.MINOR_TASKS)
    recorded = {**settings, "minor_skills": ["story"]}
    assert run.with_minor_skills(recorded) is recorded  # a run that recorded them: as it is
    other = {"ppo_prompts": families["ppo_prompts"], "pref_train": {"qa": 1}}
    with pytest.raises(InputError, match="minor skills differ"):
        run.with_minor_skills({"data": [{"families": families}, {"families": other}]})
