"""``train-reward`` and ``score`` on the real Megatron-Core BLOOM trunk.

- One 4-process torchrun launch (tests/dist_reward_train.py): AM and RM steps at TP1/TP2/PP2/
  TP2xPP2 agree (losses, updated weights) and the first loss equals a float64 transformers
  computation; a run killed in step 3 and resumed repeats the uninterrupted losses bit for bit.
- The paper's Fig. 4 effect on the synthetic "code pattern leaks into QA" preference set, with
  a tiny random BLOOM trained in-process through the ``train-reward`` command.
- ``score`` against transformers in float64 (text and token-id inputs, single responses and
  pairs), then ``eval-reward`` on its output against a NumPy accuracy/ECE reference.
- Bad input: unknown config key, wrong head, identical pair, NaN score, batch sizes, resume.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torchrun_util import assert_check, run_checks

from megatron_rlhf.reward.synthetic import SyntheticPreferenceConfig, make_synthetic_preferences

REPO = Path(__file__).resolve().parents[1]
ARCH = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4)
DIST_CHECKS = [
    f"{loss}_{name}"
    for loss in ("am", "rm")
    for name in (
        "first_step_loss_matches_hf_float64",
        *(
            f"{layout}_{what}"
            for layout in ("tp1_pp1_padded", "tp2_pp1", "tp1_pp2", "tp2_pp2")
            for what in ("losses_match_tp1", "updated_weights_match_tp1")
        ),
    )
] + [
    "killed_and_resumed_next_losses_equal_uninterrupted_bitwise",
    "killed_and_resumed_final_evaluation_equal",
    "score_tp2_pp2_equals_tp1",
]


def save_hf_bloom(directory: Path, num_outputs: int | None, seed: int, tokenizer=None) -> Path:
    """A tiny random HF BLOOM; with ``num_outputs`` also a random ``score`` head (with bias)."""
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    save_random_hf_bloom(directory, tiny_architecture(**ARCH), seed=seed)
    if num_outputs is not None:
        path = directory / "model.safetensors"
        tensors = load_file(str(path))
        generator = torch.Generator().manual_seed(seed + 1)
        shape = (num_outputs, ARCH["hidden_size"])
        tensors["score.weight"] = torch.randn(shape, generator=generator) * 0.2
        tensors["score.bias"] = torch.randn(num_outputs, generator=generator) * 0.2
        save_file(tensors, str(path), metadata={"format": "pt"})
    if tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tokenizer) / name).exists():
                (directory / name).write_bytes((Path(tokenizer) / name).read_bytes())
    return directory


def write_synthetic_pairs(prefix: Path, pairs_per_task: int, seed: int = 0) -> Path:
    from megatron_rlhf.data import Example, write_preference_dataset

    pairs = make_synthetic_preferences(
        SyntheticPreferenceConfig(num_pairs_per_task=pairs_per_task, seed=seed)
    )
    examples = [
        Example(p["prompt_ids"], (p["chosen_ids"], p["rejected_ids"]), p["task"]) for p in pairs
    ]
    write_preference_dataset(
        prefix, examples, vocab_size=ARCH["vocab_size"], pad_id=0, append_eos=False
    )
    return prefix


# ---------------------------------------------------------------- parallel layouts and resume


@pytest.fixture(scope="module")
def dist_root(tmp_path_factory):
    return tmp_path_factory.mktemp("reward_dist")


@pytest.fixture(scope="module")
def dist_results(dist_root):
    root = dist_root
    data = write_synthetic_pairs(root / "pairs", pairs_per_task=22)
    hf_am = save_hf_bloom(root / "hf_am", num_outputs=2, seed=1)
    hf_rm = save_hf_bloom(root / "hf_rm", num_outputs=1, seed=1)
    results = run_checks(
        REPO / "tests" / "dist_reward_train.py",
        4,
        root / "results",
        "--data",
        str(data),
        "--hf-am",
        str(hf_am),
        "--hf-rm",
        str(hf_rm),
        "--work",
        str(root / "work"),
    )
    return results


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("check", DIST_CHECKS)
def test_parallel_layouts_and_resume(dist_results, check):
    assert_check(dist_results, check)


@pytest.mark.launch(ranks=4)  # its checkpoint is the dist_results launch's
def test_a_run_saved_on_4_ranks_resumes_on_1_at_its_step(dist_results, dist_root, tmp_path, capsys):
    """The 4-rank launch's TP1 x DP4 AM run (2 steps) resumed in this 1-rank process for a 3rd
    step: it continues at step 2 with its data position and LR schedule (the global trainer
    state in the checkpoint's metadata), instead of restarting at step 0 with trained weights."""
    import shutil

    from megatron_rlhf.reward.train import main

    saved = dist_root / "work" / "am_tp1_pp1"  # written by the dist_results launch
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    argv = ["--config", str(run / "config.json"), f"train.output_dir={run}", "train.steps=3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"resumed from {run / 'step_0000002'} at step 2" in err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    trainer = json.loads((run / "step_0000003" / "megatron_rlhf.json").read_text())
    assert trainer["trainer_state"]["consumed_samples"] == 3 * 8  # GLOBAL_BATCH a step


# ---------------------------------------------------------------- Fig. 4 with the BLOOM trunk

FIG4_STEPS = 150
FIG4_MARGIN = 2.5


@pytest.fixture(scope="module")
def fig4(tmp_path_factory):
    """An RM and an AM trained through the CLI on the same synthetic pairs and trunk."""
    from megatron_rlhf.reward.train import main

    root = tmp_path_factory.mktemp("reward_fig4")
    data = write_synthetic_pairs(root / "pairs", pairs_per_task=1000)
    trunk = save_hf_bloom(root / "hf", num_outputs=None, seed=2)
    config = root / "fig4.yaml"
    config.write_text(
        f"model:\n  load: {trunk}\n"
        f"data:\n  train: {data}\n  eval_fraction: 0.2\n"
        "optim:\n  lr: 1.0e-3\n  weight_decay: 0.0\n"
        f"am:\n  margin: {FIG4_MARGIN}\n"
        f"train:\n  global_batch_size: 32\n  micro_batch_size: 32\n  steps: {FIG4_STEPS}\n"
        "  eval_interval: 0\n  save_interval: 0\n  log_interval: 50\n"
    )
    runs = {}
    for loss in ("rm", "am"):
        output = root / loss
        assert main(["--config", str(config), f"loss={loss}", f"train.output_dir={output}"]) == 0
        checkpoint = output / f"step_{FIG4_STEPS:07d}"
        runs[loss] = {
            "checkpoint": checkpoint,
            "eval": json.loads((checkpoint / "megatron_rlhf.json").read_text())["eval"],
        }
    return {"root": root, "data": data, **runs}


@pytest.mark.slow  # two in-process trainings of 150 steps (~20 s)
def test_fig4_rm_task_means_spread_am_means_sit_near_zero(fig4):
    rm, am = fig4["rm"]["eval"], fig4["am"]["eval"]
    report = {
        name: {
            "accuracy": round(run["accuracy"], 4),
            "ece": round(run["ece"], 2),
            "task_mean_spread": round(run["task_mean_spread"], 3),
            "outside_margin": round(run["outside_margin"], 4),
            "task_means": {t: round(row["mean"], 3) for t, row in run["per_task"].items()},
            "task_stds": {t: round(row["std"], 3) for t, row in run["per_task"].items()},
        }
        for name, run in (("RM", rm), ("AM", am))
    }
    print("\nFig. 4 on held-out synthetic pairs:", json.dumps(report, indent=1))
    assert rm["pairs"] == am["pairs"] == 600
    for loss in ("rm", "am"):  # TensorBoard events and the resolved config beside the checkpoint
        run_dir = fig4["root"] / loss
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
        saved = json.loads((fig4[loss]["checkpoint"] / "megatron_rlhf.json").read_text())
        assert saved["config"] == json.loads((run_dir / "config.json").read_text())
        assert saved["config"]["loss"] == loss and saved["config"]["train"]["steps"] == FIG4_STEPS
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train_lines = [line for line in logged if "train/loss" in line]
        assert train_lines and all(line["train/time/step_s"] > 0 for line in train_lines)
        assert all(line["train/throughput/tokens_per_s"] > 0 for line in train_lines)
    # The RM scores every QA response higher: the leaked "code pattern" lifts the whole task.
    assert rm["per_task"]["qa"]["mean"] - rm["per_task"]["chat"]["mean"] > 0.7
    assert rm["task_mean_spread"] > 4 * am["task_mean_spread"]
    # The AM's per-task means sit near 0 and its scores stay inside ±m.
    assert max(abs(row["mean"]) for row in am["per_task"].values()) < 0.25
    assert am["outside_margin"] <= 0.01
    # ... and it ranks no worse than the RM (600 pairs: ±1.7 % standard error).
    assert am["accuracy"] >= rm["accuracy"] - 0.03
    assert rm["accuracy"] > 0.7


# ---------------------------------------------------------------- score and eval-reward


def numpy_accuracy_and_ece(chosen, rejected, bins=10):
    """Accuracy (ties wrong) and ECE×100 with ties counted 1/2, computed with a plain loop."""
    correct, confidence = [], []
    for c, r in zip(chosen, rejected):
        gap = c - r
        correct.append(1.0 if gap > 0 else 0.0 if gap < 0 else 0.5)
        confidence.append(1.0 / (1.0 + math.exp(-abs(gap))))
    correct, confidence = np.array(correct), np.array(confidence)
    which = np.minimum(((confidence - 0.5) / (0.5 / bins)).astype(int), bins - 1)
    ece = 0.0
    for b in range(bins):
        members = which == b
        if members.any():
            ece += members.mean() * abs(correct[members].mean() - confidence[members].mean())
    return float((np.array(chosen) > np.array(rejected)).mean()), 100.0 * ece


def test_score_pairs_then_eval_reward_matches_reference(fig4, tmp_path):
    from megatron_rlhf.reward import evaluate, score

    out = tmp_path / "pairs_scored.jsonl"
    args = ["--load", str(fig4["am"]["checkpoint"]), "--input", str(fig4["data"])]
    assert score.main([*args, "--output", str(out), "--batch-size", "64"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3000 and {line["task"] for line in lines} == {"code", "qa", "chat"}
    assert all(set(line) == {"chosen_score", "rejected_score", "task"} for line in lines)
    assert all(abs(line["chosen_score"]) < 2 * FIG4_MARGIN for line in lines)
    assert evaluate.main(["--scores", str(out), "--output-dir", str(tmp_path / "eval")]) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    chosen = [line["chosen_score"] for line in lines]
    rejected = [line["rejected_score"] for line in lines]
    accuracy, ece = numpy_accuracy_and_ece(chosen, rejected)
    assert summary["num_pairs"] == 3000
    assert summary["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert summary["ece"] == pytest.approx(ece, abs=1e-9)
    for task in ("code", "qa", "chat"):
        mine = [line for line in lines if line["task"] == task]
        scores = [line["chosen_score"] for line in mine] + [line["rejected_score"] for line in mine]
        assert summary["per_task"][task]["mean"] == pytest.approx(np.mean(scores), abs=1e-9)


def test_score_rm_writes_reward_only(fig4, tmp_path):
    from megatron_rlhf.reward import score

    source = tmp_path / "gen.jsonl"
    source.write_text(
        "\n".join(
            json.dumps({"prompt_token_ids": [32, 33, 34], "response_token_ids": ids, "id": i})
            for i, ids in enumerate([[2, 3, 4], [10, 11], [2, 1, 5, 18]])
        )
    )
    out = tmp_path / "rm.jsonl"
    rm = str(fig4["rm"]["checkpoint"])
    assert score.main(["--load", rm, "--input", str(source), "--output", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [0, 1, 2]
    assert all(
        set(line) == {"prompt_token_ids", "response_token_ids", "id", "reward", "score"}
        for line in lines
    )
    assert all(line["score"] == line["reward"] for line in lines)
    # good tokens (2-9) beat bad ones (10-17) in every task, so the trained RM must agree
    assert lines[0]["reward"] > lines[1]["reward"]


@pytest.fixture(scope="module")
def converted_am(tmp_path_factory):
    """A 2-output HF BLOOM with a random score head and a tiny tokenizer, converted to a
    megatron-rlhf checkpoint: scores of the checkpoint must equal transformers' on the HF dir."""
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.data import train_tiny_tokenizer

    root = tmp_path_factory.mktemp("reward_score")
    tokenizer = train_tiny_tokenizer(None, root / "tokenizer", vocab_size=400)
    hf = save_hf_bloom(root / "hf", num_outputs=2, seed=3, tokenizer=tokenizer)
    checkpoint = root / "am"
    argv = ["hf-to-megatron", "--load", str(hf), "--save", str(checkpoint), "--head", "scalar"]
    assert convert([*argv, "--num-scalar-outputs", "2"]) == 0
    return {"hf": hf, "checkpoint": checkpoint, "tokenizer": tokenizer}


@functools.cache
def hf_trunk_and_head(hf_dir: Path):
    from transformers import BloomModel

    trunk = BloomModel.from_pretrained(str(hf_dir)).double().eval()
    tensors = load_file(str(hf_dir / "model.safetensors"))
    return trunk, tensors["score.weight"].double(), tensors["score.bias"].double()


def hf_scalars(hf_dir: Path, prompt_ids: list[int], response_ids: list[int]) -> tuple:
    """(r, e_τ) in float64 from transformers' BLOOM trunk and the HF score head, unpadded."""
    trunk, weight, bias = hf_trunk_and_head(hf_dir)
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        hidden = trunk(ids).last_hidden_state[0]  # (S, H)
    scalars = hidden @ weight.T + bias  # (S, 2)
    return scalars[-1, 0].item(), scalars[len(prompt_ids) - 1, 1].item()


def test_score_matches_transformers_float64(converted_am, tmp_path):
    from transformers import AutoTokenizer

    from megatron_rlhf.reward import score

    tokenizer = AutoTokenizer.from_pretrained(str(converted_am["tokenizer"]))
    eos = tokenizer.eos_token_id
    source = tmp_path / "mixed.jsonl"
    records = [
        {"prompt": "Where is the red boat?", "response": " It is in the garden.", "k": 1},
        {"prompt_token_ids": [40, 41, 42, 43, 44], "response_token_ids": [50, 51], "k": 2},
        {"prompt": "Hi", "response_token_ids": [60, 61, 62, 63, 64, 65, 66, 2], "k": 3},
    ]
    source.write_text("\n\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "scored.jsonl"
    argv = ["--load", str(converted_am["checkpoint"]), "--input", str(source)]
    assert score.main([*argv, "--output", str(out), "--batch-size", "2"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["k"] for line in lines] == [1, 2, 3]

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    expected_inputs = [
        (ids(records[0]["prompt"]), ids(records[0]["response"]) + [eos]),  # EOS appended to text
        (records[1]["prompt_token_ids"], records[1]["response_token_ids"]),
        (ids("Hi"), records[2]["response_token_ids"]),  # token ids scored as given
    ]
    for line, (prompt, response) in zip(lines, expected_inputs):
        reward, expected = hf_scalars(converted_am["hf"], prompt, response)
        assert line["reward"] == pytest.approx(reward, abs=1e-5)
        assert line["expected_reward"] == pytest.approx(expected, abs=1e-5)
        assert line["advantage"] == pytest.approx(reward - expected, abs=1e-5)
        assert line["score"] == line["advantage"]

    pairs = tmp_path / "pairs.jsonl"
    pair = {"prompt": "Who paints?", "chosen": " The baker paints.", "rejected": " No.", "task": 7}
    hh = {
        "chosen": "\n\nHuman: Hi?\n\nAssistant: Hello there.",
        "rejected": "\n\nHuman: Hi?\n\nAssistant: Go away.",
    }
    pairs.write_text(json.dumps(pair) + "\n" + json.dumps(hh) + "\n")
    assert score.main([*argv[:2], "--input", str(pairs), "--output", str(out), "--overwrite"]) == 0
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["task"] == "7" and "task" not in second
    for line, (prompt, chosen, rejected) in zip(
        (first, second),
        (
            (pair["prompt"], pair["chosen"], pair["rejected"]),
            ("\n\nHuman: Hi?\n\nAssistant:", " Hello there.", " Go away."),
        ),
    ):
        for side, text in (("chosen_score", chosen), ("rejected_score", rejected)):
            reward, expected = hf_scalars(converted_am["hf"], ids(prompt), ids(text) + [eos])
            assert line[side] == pytest.approx(reward - expected, abs=1e-5)


# ---------------------------------------------------------------- bad input


def test_unknown_config_key_is_named(tmp_path, capsys):
    from megatron_rlhf.reward.train import main

    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  load: x\ndata:\n  train: y\ntrain:\n  output_dir: z\n")
    assert main(["--config", str(config), "optim.lrr=1e-5"]) == 2
    assert "unknown config key optim.lrr; did you mean optim.lr?" in capsys.readouterr().err
    config.write_text("loss: am\nmodel:\n  load: x\n  tpp: 2\ndata:\n  train: y\n")
    assert main(["--config", str(config)]) == 2
    assert f"{config}: unknown config key model.tpp" in capsys.readouterr().err


def test_wrong_head_checkpoint_is_named(fig4, tmp_path, capsys):
    from megatron_rlhf.reward.train import main

    rm = fig4["rm"]["checkpoint"]
    argv = [f"model.load={rm}", f"data.train={fig4['data']}", f"train.output_dir={tmp_path}"]
    assert main(["loss=am", "train.steps=1", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{rm}: holds a 'scalar' head with 1 scalar outputs" in err and "with 2" in err
    # resuming an RM run as an AM run is refused too: as a changed config, and even when forced
    argv[-1] = f"train.output_dir={fig4['root'] / 'rm'}"
    assert main(["loss=am", *argv]) == 2
    changed = capsys.readouterr().err.split("resuming with a changed config (")[1].split(")")[0]
    assert "loss" in changed.split(", ")
    assert main(["loss=am", *argv, "--force-config-change"]) == 2
    assert "was trained with loss='rm'" in capsys.readouterr().err


def test_score_refuses_models_without_a_trained_head(fig4, tmp_path, capsys):
    from megatron_rlhf.reward import score

    hf = fig4["root"] / "hf"
    argv = ["--load", str(hf), "--input", str(fig4["data"]), "--output", str(tmp_path / "o")]
    assert score.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--load: {hf} is a Hugging Face BloomForCausalLM, not a reward model" in err
    assert "train one with `train-reward`" in err
    assert not (tmp_path / "o").exists()


def test_identical_pair_is_named(fig4, tmp_path, capsys):
    from megatron_rlhf.data import Example, write_preference_dataset
    from megatron_rlhf.reward.train import main

    prefix = tmp_path / "dup"
    examples = [Example([40, 41], ([2, 3], [10, 11])) for _ in range(5)]
    examples[3] = Example([40, 41], ([2, 3, 4], [2, 3, 4]))
    write_preference_dataset(prefix, examples, vocab_size=ARCH["vocab_size"], append_eos=False)
    argv = [f"model.load={fig4['root'] / 'hf'}", f"data.train={prefix}"]
    assert main([*argv, f"train.output_dir={tmp_path / 'run'}", "train.global_batch_size=2"]) == 2
    err = capsys.readouterr().err
    assert f"{prefix}: pair 3 (0-based record" in err and "identical chosen and rejected" in err


def test_nan_score_is_named(tmp_path, capsys):
    from megatron_rlhf.reward import evaluate

    scores = tmp_path / "s.jsonl"
    scores.write_text(
        '{"chosen_score": 1.0, "rejected_score": 0.5}\n'
        '{"chosen_score": NaN, "rejected_score": 0.5}\n'
    )
    assert evaluate.main(["--scores", str(scores), "--output-dir", str(tmp_path / "e")]) == 2
    assert f"{scores}:2: chosen_score: score is nan" in capsys.readouterr().err


def test_batch_sizes_that_do_not_divide_are_named(fig4, tmp_path, capsys):
    from megatron_rlhf.reward.train import main

    argv = [f"model.load={fig4['root'] / 'hf'}", f"data.train={fig4['data']}"]
    argv += [
        f"train.output_dir={tmp_path}",
        "train.global_batch_size=7",
        "train.micro_batch_size=2",
    ]
    assert main(argv) == 2
    assert "train.global_batch_size=7 is not a multiple of train.micro_batch_size=2" in (
        capsys.readouterr().err
    )


# ---------------------------------------------------------------- example configs


def test_example_configs_load_with_the_paper_settings():
    from megatron_rlhf.config import load_config
    from megatron_rlhf.reward.train import RewardTrainConfig

    paper = load_config(RewardTrainConfig, REPO / "examples/reward/bloomz_7b1_am.yaml")
    assert paper.loss == "am" and paper.am.margin == 2.5 and paper.train.epochs == 1.0
    assert paper.optim.lr == 5e-6 and paper.optim.warmup_fraction == 0.1
    assert paper.optim.min_lr_ratio == 0.1 and paper.train.global_batch_size == 180
    tiny = load_config(RewardTrainConfig, REPO / "examples/reward/tiny_cpu.yaml")
    assert tiny.train.bf16 == "auto"


def test_pure_helpers_read_the_right_positions():
    from megatron_rlhf.reward.model import last_token_positions, read_scalars

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
    assert last_token_positions(mask).tolist() == [2, 4, 3]
    output = torch.randn(3, 5, 2, dtype=torch.float64)
    rewards, expected = read_scalars(output, mask, torch.tensor([1, 3, 4]))
    assert torch.equal(rewards, output[[0, 1, 2], [2, 4, 3], 0])
    assert torch.equal(expected, output[[0, 1, 2], [0, 2, 3], 1])
    rm_rewards, none = read_scalars(output[..., :1], mask, None)
    assert none is None and torch.equal(rm_rewards, rewards)


@pytest.mark.parametrize("policy_column", [None, 1])
def test_am_loss_fn_matches_float64_eq8(policy_column):
    """The training loss on a (2P, S, 2) head output: positions, Eq. 8 weights, Eq. 6."""
    from megatron_rlhf.reward.train import AMConfig, make_loss_fn

    config = type("C", (), {"loss": "am", "am": AMConfig(margin=1.7, policy_column=policy_column)})
    generator = torch.Generator().manual_seed(5)
    pairs, width, policies = 3, 7, 2
    prompt_lengths = torch.tensor([2, 3, 1])
    lengths = torch.tensor([5, 7, 4, 6, 3, 2])  # chosen rows then rejected rows
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    output = torch.randn(2 * pairs, width, 2, generator=generator, dtype=torch.float64)
    logprobs = -torch.rand(2, pairs, policies, generator=generator, dtype=torch.float64) * 3
    microbatch = {
        "padding_mask": mask,
        "prompt_lengths": prompt_lengths.repeat(2),
        "chosen_logprobs": logprobs[0],
        "rejected_logprobs": logprobs[1],
    }
    sink = []
    loss, metrics = make_loss_fn(config, sink)(output, microbatch)
    expected_terms, advantages = [], []
    for pair in range(pairs):
        side_advantages = []
        for side, row in enumerate((pair, pair + pairs)):
            reward = output[row, lengths[row] - 1, 0].item()
            expected = output[row, prompt_lengths[pair] - 1, 1].item()
            if policy_column is None:
                side_advantages.append(reward - expected)
                continue
            row_logprobs = logprobs[side, pair].tolist()
            policy = row_logprobs[policy_column]
            n = policies + 1  # default N = K + 1
            weights = [min(math.exp(policy - lp), 1.0) for lp in row_logprobs]  # clipped
            side_advantages.append(
                reward - (n - policies) / n * expected - sum(weights) / n * reward
            )
        chosen, rejected = side_advantages
        advantages.append(side_advantages)
        expected_terms.append(
            -math.log(1 / (1 + math.exp(-(chosen - rejected))))
            - math.log(1 / (1 + math.exp(-(1.7 - chosen))))
            - math.log(1 / (1 + math.exp(-(1.7 + rejected))))
        )
    assert loss.item() == pytest.approx(sum(expected_terms) / pairs, abs=1e-12)
    chosen_scores, rejected_scores, _ = sink[0]
    assert chosen_scores == pytest.approx([a[0] for a in advantages], abs=1e-12)
    assert rejected_scores == pytest.approx([a[1] for a in advantages], abs=1e-12)
    assert metrics["accuracy"].item() == pytest.approx(np.mean([c > r for c, r in advantages]))
