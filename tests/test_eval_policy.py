"""``eval-policy`` end to end on tiny random BLOOMs: counts against an independent recount,
responses against transformers' greedy decoding, AM judge scores against an unpadded forward,
train-ppo checkpoints as the policy, two data-parallel ranks, bad inputs."""

from __future__ import annotations

import functools
import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrun_util import launch_env, torchrun_command

from megatron_rlhf.data import load_tokenizer, train_tiny_tokenizer
from megatron_rlhf.models.bloom.tiny import random_hf_bloom, tiny_architecture
from megatron_rlhf.ppo.evaluate import main
from megatron_rlhf.ppo.evaluate_report import verdicts

REPO = Path(__file__).resolve().parents[1]
ARCH = tiny_architecture(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)
SCORE_FN = f"{Path(__file__).stem}:low_token_share"
MAX_NEW = 9


def make_checkpoints(root: Path) -> None:
    """An AM judge converted from the SFT model, and a train-ppo run whose actor holds the
    HF policy's weights (with a critic beside it, as train-ppo saves them)."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.checkpoint.dist import model_metadata
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.training import OptimConfig, TrainEngine
    from megatron_rlhf.training.checkpointing import save_training_checkpoint

    args = ["hf-to-megatron", "--load", str(root / "sft"), "--save", str(root / "am")]
    assert convert(args + ["--head", "scalar", "--num-scalar-outputs", "2"]) == 0
    initialize()
    try:
        policy = root / "policy"
        actor = load_bloom(policy, init_weights=False)
        critic = load_bloom(policy, head="scalar", num_scalar_outputs=1, trunk_only=True)
        engines = {
            "actor": TrainEngine(actor, OptimConfig(), 1, "actor."),
            "critic": TrainEngine(critic, OptimConfig(), 1, "critic."),
        }
        meta = model_metadata(actor, roles=["actor", "critic"])
        save_training_checkpoint(root / "ppo_run", 3, engines, meta, {"step": 3})
    finally:
        destroy()


def low_token_share(prompt_ids, response_ids):
    """The test's score function: share of response tokens below 150."""
    return sum(token < 150 for token in response_ids) / max(len(response_ids), 1)


def write_prompts(path: Path, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(4, ARCH.vocab_size) for _ in range(rng.randint(1, 9))] for _ in range(count)
    ]
    lines = [json.dumps({"prompt_token_ids": ids, "tag": i}) for i, ids in enumerate(prompts)]
    path.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")  # a blank line is skipped
    return prompts


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_policy")
    for name, seed in (("sft", 0), ("policy", 1)):  # peaked logits: the two models disagree
        random_hf_bloom(ARCH, seed, init_std=0.3).save_pretrained(root / name)
    main_prompts = write_prompts(root / "main.jsonl", 13, 0)
    forget_prompts = write_prompts(root / "forget.jsonl", 6, 1)
    other = tiny_architecture(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4)
    random_hf_bloom(other).save_pretrained(root / "other_vocab")
    make_checkpoints(root)
    train_tiny_tokenizer(None, root / "tokenizer", vocab_size=ARCH.vocab_size)
    texts = ["The cat sat on", "Why is the sky blue?", "a", "Tell me about  rivers\n", "42 + 1 ="]
    (root / "text.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return {"root": root, "main": main_prompts, "forget": forget_prompts, "texts": texts}


def run_eval(data, out: Path, *extra: str, policy=None, sets=("main", "forget")) -> dict:
    root = data["root"]
    argv = ["--policy", str(policy or root / "policy"), "--sft", str(root / "sft")]
    for name in sets:
        argv += [f"--{name}", str(root / f"{name}.jsonl")]
    argv += ["--max-new-tokens", str(MAX_NEW), "--batch-size", "4", "--output-dir", str(out)]
    assert main(argv + list(extra)) == 0
    report = json.loads((out / "eval_policy.json").read_text())
    samples = read_samples(out)
    return {"report": report, "samples": samples, "markdown": (out / "eval_policy.md").read_text()}


def read_samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval_policy_samples.jsonl").open()]


def recount(samples: list[dict], margin: float) -> dict:
    """Plain-Python win/tie/lose from the samples' scores (identical responses tie)."""
    counts = {"win": 0, "tie": 0, "lose": 0}
    for s in samples:
        diff = s["policy_score"] - s["sft_score"]
        same = s["policy_response_token_ids"] == s["sft_response_token_ids"]
        counts["tie" if same or abs(diff) <= margin else "win" if diff > 0 else "lose"] += 1
    return counts


def test_verdicts_at_the_margin_and_for_identical_responses():
    policy = torch.tensor([0.5, 0.25, 0.0, 1.0, -2.0, 3.0])
    sft = torch.tensor([0.25, 0.5, 0.25, 0.0, 1.0, 3.0])
    identical = torch.tensor([False, False, False, False, True, False])
    assert verdicts(policy, sft, identical, 0.25).tolist() == [0, 0, 0, 1, 0, 0]
    assert verdicts(policy, sft, identical, 0.0).tolist() == [1, -1, -1, 1, 0, 0]


def test_score_fn_counts_match_an_independent_recount(data, tmp_path, capsys):
    margin = 0.1
    # Seed 1: the draws must give all three verdicts (the default seed gave no "lose" after the
    # sampler moved to one uniform per (step, row); seeds 1, 2 and 3 all do).
    extra = ("--score-fn", SCORE_FN, "--tie-margin", str(margin), "--seed", "1")
    result = run_eval(data, tmp_path, *extra)
    summary = [line for line in capsys.readouterr().out.splitlines() if "[eval-policy]" in line]
    assert len(summary) == 1 and f" judge={SCORE_FN} judge_kind=score_fn " in summary[0]
    sets = result["report"]["sets"]
    assert result["report"]["settings"]["tie_margin"] == margin
    verdict_kinds = set()
    for name in ("main", "forget"):
        samples = [s for s in result["samples"] if s["set"] == name]
        assert [s["index"] for s in samples] == list(range(len(data[name])))
        assert [s["prompt_token_ids"] for s in samples] == data[name]
        assert [s["tag"] for s in samples] == list(range(len(data[name])))  # fields carried
        for s in samples:
            for who in ("policy", "sft"):
                rescored = low_token_share(s["prompt_token_ids"], s[f"{who}_response_token_ids"])
                assert s[f"{who}_score"] == pytest.approx(rescored, abs=1e-6)
                assert 1 <= len(s[f"{who}_response_token_ids"]) <= MAX_NEW
            verdict_kinds.add(s["verdict"])
        counts, row, n = recount(samples, margin), sets[name], len(samples)
        assert {key: row[key] for key in counts} == counts
        assert row["num_prompts"] == n
        assert row["win_rate"] == pytest.approx(counts["win"] / n)
        assert row["net_win_rate"] == pytest.approx((counts["win"] - counts["lose"]) / n)
        for who in ("policy", "sft"):
            mean = sum(s[f"{who}_score"] for s in samples) / n
            assert row[f"mean_score_{who}"] == pytest.approx(mean, abs=1e-12)
        assert f"| {name} | {n} | {100 * counts['win'] / n:.2f} |" in result["markdown"]
        win, tie, lose = (100 * counts[key] / n for key in ("win", "tie", "lose"))
        assert (  # the one-line summary in the report's units (percent of the set's prompts)
            f" {name}_win_tie_lose_pct={win:.1f}/{tie:.1f}/{lose:.1f} "
            f"{name}_net_win_pct={win - lose:+.1f} " in summary[0]
        )
    assert verdict_kinds == {"win", "tie", "lose"}  # the test exercises all three outcomes
    assert "| Model | Main Win ↑ | Main Lose ↓ | Main Tie | Forget Win ↑" in result["markdown"]


@functools.cache
def hf_model(model_dir: Path):
    from transformers import BloomForCausalLM

    return BloomForCausalLM.from_pretrained(model_dir).eval()


def hf_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    """transformers' greedy decoding, cut after the first EOS (the engine stops there)."""
    out = hf_model(model_dir).generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2,
        pad_token_id=3, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )[0, len(prompt) :].tolist()  # fmt: skip
    return out[: out.index(2) + 1] if 2 in out else out


def test_greedy_responses_come_from_each_model_and_ppo_checkpoints_load(data, tmp_path):
    root = data["root"]
    hf = run_eval(data, tmp_path / "hf", "--score-fn", SCORE_FN, "--greedy")
    for s in hf["samples"][::4]:  # the responses are each model's own (never swapped)
        assert s["policy_response_token_ids"] == hf_greedy(root / "policy", s["prompt_token_ids"])
        assert s["sft_response_token_ids"] == hf_greedy(root / "sft", s["prompt_token_ids"])
    assert any(s["verdict"] != "tie" for s in hf["samples"])
    # a train-ppo output dir (its latest step, actor weights = the HF policy's) gives the same
    ppo = run_eval(data, tmp_path / "ppo", "--score-fn", SCORE_FN, "--greedy",
                   policy=root / "ppo_run")  # fmt: skip
    assert ppo["samples"] == hf["samples"]
    assert ppo["report"]["settings"]["policy"].endswith("step_0000003")


def test_text_prompts_are_tokenized_and_responses_decoded(data, tmp_path):
    root = data["root"]
    argv = ["--policy", str(root / "policy"), "--sft", str(root / "sft"), "--main",
            str(root / "text.jsonl"), "--tokenizer", str(root / "tokenizer"), "--score-fn",
            SCORE_FN, "--greedy", "--max-new-tokens", str(MAX_NEW), "--output-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    tokenizer = load_tokenizer(root / "tokenizer")
    samples = read_samples(tmp_path)
    assert [s["prompt"] for s in samples] == data["texts"]
    for s in samples:
        prompt_ids = tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]
        for who in ("policy", "sft"):
            ids = s[f"{who}_response_token_ids"]
            assert ids == hf_greedy(root / who, prompt_ids)
            assert s[f"{who}_response"] == tokenizer.decode(ids, skip_special_tokens=True)
    table = (tmp_path / "eval_policy.md").read_text()
    assert "| main | 5 |" in table and "Forget" not in table  # no --forget: one set


@pytest.mark.parametrize("judge", ["am", "score-fn"])
def test_policy_equal_to_sft_gives_all_ties(data, tmp_path, judge):
    """Greedy with the AM judge at margin 0; sampling (same seed) with the score function."""
    root = data["root"]
    extra = (
        ["--greedy", "--judge", str(root / "am")]
        if judge == "am"
        else ["--temperature", "0.8", "--seed", "5", "--score-fn", SCORE_FN]
    )
    result = run_eval(data, tmp_path, *extra, policy=root / "sft", sets=("main",))
    row = result["report"]["sets"]["main"]
    assert (row["win"], row["lose"], row["tie"]) == (0, 0, len(data["main"]))
    assert row["net_win_rate"] == 0.0 and row["mean_score_policy"] == row["mean_score_sft"]
    assert all(s["score_diff"] == 0.0 for s in result["samples"])


def am_reference_scores(judge_dir: Path, samples: list[dict]) -> list[tuple[float, float]]:
    """a = r(last token) - e_tau(last prompt token), one unpadded sequence at a time."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import destroy, initialize

    initialize()
    try:
        judge = load_bloom(judge_dir, head="scalar", num_scalar_outputs=2, init_weights=False)
        judge.eval()
        scores = []
        with torch.no_grad():
            for s in samples:
                pair = []
                for who in ("policy", "sft"):
                    ids = s["prompt_token_ids"] + s[f"{who}_response_token_ids"]
                    out = judge(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
                    pair.append(float(out[-1, 0] - out[len(s["prompt_token_ids"]) - 1, 1]))
                scores.append(tuple(pair))
        return scores
    finally:
        destroy()


AM_MARGIN = 0.01


def am_argv(root: Path) -> list[str]:
    return ["--policy", str(root / "policy"), "--sft", str(root / "sft"), "--main",
            str(root / "main.jsonl"), "--forget", str(root / "forget.jsonl"), "--judge",
            str(root / "am"), "--judge-kind", "am", "--tie-margin", str(AM_MARGIN), "--greedy",
            "--max-new-tokens", str(MAX_NEW), "--batch-size", "3"]  # fmt: skip


@pytest.fixture(scope="module")
def am_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("am_run")
    assert main(am_argv(data["root"]) + ["--output-dir", str(out)]) == 0
    return {
        "report": json.loads((out / "eval_policy.json").read_text()),
        "samples": read_samples(out),
    }


def test_am_judge_scores_match_an_unpadded_forward(data, am_run):
    samples = am_run["samples"]
    for s, (policy, sft) in zip(samples, am_reference_scores(data["root"] / "am", samples)):
        assert s["policy_score"] == pytest.approx(policy, abs=1e-5)
        assert s["sft_score"] == pytest.approx(sft, abs=1e-5)
    for name in ("main", "forget"):
        in_set = [s for s in samples if s["set"] == name]
        row = am_run["report"]["sets"][name]
        assert {key: row[key] for key in ("win", "tie", "lose")} == recount(in_set, AM_MARGIN)
    assert {s["verdict"] for s in samples} == {"win", "tie", "lose"}
    assert am_run["report"]["settings"]["judge_kind"] == "am"


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize(
    "layout",
    [[], ["--parallel", "policy.tp=2", "judge.tp=1"]],
    ids=["dp2", "policy_tp2_judge_tp1"],
)
def test_two_ranks_equal_one(data, am_run, tmp_path, layout):
    """Two ranks, as two data-parallel replicas of both roles, or with the policy at TP2 (one
    replica) and the judge at TP1 (two replicas, each scoring half the batches), give the
    single-process report."""
    argv = [*am_argv(data["root"]), "--output-dir", str(tmp_path), *layout]
    cmd = torchrun_command(2, "-m", "megatron_rlhf", "eval-policy", *argv)
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[eval-policy] done:") == 1  # rank 0 only
    two, one = read_samples(tmp_path), am_run["samples"]
    assert len(two) == len(one) == len(data["main"]) + len(data["forget"])
    for a, b in zip(two, one):
        assert (a["set"], a["index"], a["verdict"]) == (b["set"], b["index"], b["verdict"])
        for who in ("policy", "sft"):
            assert a[f"{who}_response_token_ids"] == b[f"{who}_response_token_ids"]
            assert a[f"{who}_score"] == pytest.approx(b[f"{who}_score"], abs=1e-5)


BAD = {
    "no judge": ([], "give exactly one judge"),
    "two judges": (["--judge", "{root}/am", "--score-fn", SCORE_FN], "give exactly one judge"),
    "missing policy": (["--score-fn", SCORE_FN, "--policy", "{root}/nope"], "nope"),
    "missing prompts": (["--score-fn", SCORE_FN, "--main", "{root}/none.jsonl"], "no such file"),
    "empty prompts": (["--score-fn", SCORE_FN, "--main", "{root}/empty.jsonl"], "no prompts"),
    "text prompt, no tokenizer": (
        ["--score-fn", SCORE_FN, "--main", "{root}/text.jsonl"],
        "needs --tokenizer",
    ),
    "LM as judge": (["--judge", "{root}/sft"], "not a trained reward/advantage model"),
    "AM as RM": (["--judge", "{root}/am", "--judge-kind", "rm"], "needs a scalar head with 1"),
    "scalar head as policy": (["--score-fn", SCORE_FN, "--policy", "{root}/am"], "language model"),
    "tp not dividing": (
        ["--score-fn", SCORE_FN, "--tp", "3"],
        "policy layout (--parallel policy.tp=3 policy.pp=1): invalid parallel layout",
    ),
    "unknown layout role": (
        ["--score-fn", SCORE_FN, "--parallel", "critic.tp=2"],
        "--parallel critic.tp=2: unknown role 'critic'; roles: policy, judge",
    ),
    "tp twice": (["--score-fn", SCORE_FN, "--tp", "2", "--parallel", "tp=2"], "give one"),
    "vocabularies differ": (["--score-fn", SCORE_FN, "--sft", "{root}/other_vocab"], "differ"),
    "unknown score fn": (["--score-fn", "no_such_module_xyz:f"], "cannot import"),
    "negative margin": (["--score-fn", SCORE_FN, "--tie-margin", "-1"], "--tie-margin"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_fail_clearly_before_loading_models(data, tmp_path, capsys, case):
    root = data["root"]
    (root / "empty.jsonl").write_text("\n")
    (root / "text.jsonl").write_text('{"prompt": "hello"}\n')
    extra, message = BAD[case]
    base = {"--policy": str(root / "policy"), "--sft": str(root / "sft"),
            "--main": str(root / "main.jsonl"), "--output-dir": str(tmp_path / "out")}  # fmt: skip
    extra = [arg.format(root=root) for arg in extra]
    for flag in list(base):
        if flag in extra:
            del base[flag]
    argv = [item for pair in base.items() for item in pair] + extra
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()  # failed before torch.distributed and any model
    assert not (tmp_path / "out").exists()
