"""A PPO step at BLOOM's real width and vocabulary: our ``train-ppo`` against TRL's PPOTrainer
(issue 19), the same models, prompts and settings, side by side.

    python benchmarks/bench_ppo_real_shapes.py --trl-python /path/to/venv-with-trl/bin/python \\
        [--reps 3 --seeds 0 1 --steps 4 --size 560m]

TRL lives in its own virtual environment so that ours stays as the README installs it; make it
once with the same torch and transformers (``python -m venv --system-site-packages ENV &&
ENV/bin/pip install trl==1.12.0``) and pass its interpreter. Without ``--trl-python`` only our
side runs.

Models: random BLOOMs built with transformers (``models/bloom/tiny.py``), one set per seed:
``560m`` = BLOOM-560m's width and vocabulary (hidden 1,024, 16 heads, vocab 250,880) with 4
layers; ``tiny`` = 4 layers x 128, vocab 512. The actor/reference is a ``BloomForCausalLM``;
the reward model and the critic's initialisation one ``BloomForSequenceClassification`` (1
label), as TRL's examples set them up. Prompts: 8 per step, 16 random tokens each (no padding),
32 sampled new tokens (temperature 1; EOS is one token in 250,880, so rows run to the end on
both sides). PPO: 1 epoch, 1 minibatch of 8, micro-batches of 4 (TRL: 4 per device x 2
accumulation steps), k1 KL at 0.05, clip 0.2 / 0.2, gamma 1, lambda 0.95, whitened advantages,
Adam at lr 1e-6 for actor and critic, fp32, no checkpoints, ``--threads`` torch threads.

Each repetition runs both sides as fresh processes, one after the other, the order alternating.
A process runs ``--steps`` PPO steps; step 1 is a warm-up and steps 2.. are timed. Per side:
the median step of the process (and its phases: rollout, scoring, update, and the optimizer
inside the update: gradient norm, clipping and the step, ours from ``*/time/optimizer_s``;
TRL's phases are timed by wrapping its ``batch_generation``, its no-grad forwards and its
optimizer's ``step``), the peak RSS of the
process (``wait4``), and start-up (launch to the first step's start). The table gives min /
median / max over reps x seeds and the ratio of medians per seed; a claim holds only where every
seed shows it. At the tiny size EOS is one token in 512, so a few of our rows end early (our
engine stops computing them); TRL's ``generate`` runs every row to 32 tokens.

Measured (idle 2-core AMD EPYC VM, AVX-512, 24 GB; torch 2.13.0 CPU, MKL; 2026-12-01):

    | 560m | step (s)           | rollout            | scoring         | update             | optimizer       | peak RSS (GB)         | start-up (s) |
    | ours | 14.4 / 16.2 / 19.1 | 5.4 / 6.6 / 8.0    | 2.6 / 2.9 / 3.4 | 6.3 / 6.8 / 7.7    | 0.6 / 0.7 / 1.4 | 12.31 / 12.36 / 12.44 | 10 / 11 / 15 |
    | TRL  | 29.0 / 31.8 / 34.4 | 9.9 / 10.6 / 11.3  | 2.3 / 2.7 / 3.0 | 16.4 / 18.2 / 19.5 | 0.4 / 0.5 / 1.0 | 15.61 / 15.73 / 15.86 | 6 / 7 / 8    |
    TRL step / our step, medians: 1.97x (per seed: 2.00x, 1.87x)

    | tiny | step (s)           | rollout            | scoring            | update             | optimizer | peak RSS (GB)      | start-up (s) |
    | ours | 0.28 / 0.31 / 0.34 | 0.09 / 0.12 / 0.13 | 0.05 / 0.06 / 0.07 | 0.12 / 0.14 / 0.15 | 0.01      | 0.51 / 0.51 / 0.52 | 5 / 5 / 5    |
    | TRL  | 0.76 / 0.81 / 0.90 | 0.10 / 0.12 / 0.14 | 0.03 / 0.04 / 0.05 | 0.63 / 0.66 / 0.73 | 0.00      | 0.65 / 0.66 / 0.66 | 5 / 6 / 6    |
    TRL step / our step, medians: 2.65x (per seed: 2.51x, 2.78x)

(``--steps 4`` at 560m, ``--steps 6`` tiny.) The same VM on 2026-12-05, after the fp32 CPU
products moved to oneDNN (``models/cpu_linear.py``; ``--mkl-side`` runs the MKL side beside it):
560m ours 9.0 s, with MKL 12.7 s, TRL 23.6 s (2.61x); tiny ours 0.20 s, TRL 0.64 s (3.18x); the
README has the tables. BLOOM-1b7's width (hidden 2,048, the same
vocabulary, 4 layers: ~0.71B parameters a role) needs ~29 GB for the four roles' fp32 weights
and the two trained roles' gradients and Adam moments on either side, more than this machine.

How the 560m step went from 0.90x TRL to 1.97x. Before (commit 40640b2, one rep, seed 0): ours
38.1 s (rollout 9.0, scoring 7.3, update 21.8; peak RSS 14.0 GB, start-up 22 s), TRL 34.3 s
(11.0 / 3.0 / 20.3; 15.5 GB). ``py-spy record`` (20 Hz, with ``--native`` for the backward) of a
train-ppo run, and what each finding became (each step re-measured, one rep, seed 0):

1. Adam was 40 % of the update. Without TE/Apex, Megatron-Core builds ``torch.optim.AdamW``
   with torch's defaults, which on CPU tensors is the per-tensor loop: 1.2-1.7 s per step of
   307M parameters against 0.17 s for torch's fused kernel, twice a PPO step (actor, critic).
   ``training/engine.fuse_cpu_adam`` switches CPU parameter groups to the fused kernel.
2. Scoring ran an actor forward over the finished sequences for log pi_old, which the rollout
   had already computed for the tokens it sampled (same weights, temperature 1; in fp32 the two
   agree to ~1e-6). ``ppo.old_logprobs`` (auto: the rollout's where they agree to rounding,
   i.e. fp32 weights at temperature 1; recompute under bf16, where a KV-cached decode and a
   full forward differ by ~1e-2 in a log-prob, or at another temperature).
3. The LM head projected every position, but the losses read only the positions that predict
   a response (or rehearsal) token: 32 of 48 here, a minority of a row on real prompts.
   ``BloomModel.forward(output_positions=...)`` runs the vocabulary projection on those columns
   only (reference scoring and the actor's update). Steps 1-3: 38.1 -> 23.6 s.
4. In the decode, ``F.linear`` of 8 rows x 1,024 x 250,880 took 0.18-0.20 s: MKL splits that
   product badly over 2 cores; 4,096-row vocabulary slices take 0.12 s together (1 row: 0.063 s
   either way; from 128 rows up the gain is within the noise, so those stay one call).
   ``models/bloom/vocab.vocab_projection``: rollout
   8.3 -> 6.0 s, step 23.6 -> 20.9 s.
5. Per micro-batch and role the embedding's backward zeroed a fresh dense 1 GB gradient
   (``embedding_dense_backward``, page-faulted: 0.43 s with DDP's add into ``main_grad``), and
   the tied LM head's weight gradient was another fresh 1 GB (0.89 s against 0.45 s for one
   ``addmm_`` into ``main_grad``). ``models/bloom/vocab.py`` writes both straight into
   Megatron's gradient buffer (TP 1 without sequence parallelism): update 12.0 -> 7.2 s, peak
   RSS 14.0 -> 12.4 GB, the same gradient norms.
6. Start-up: the critic was built with Megatron's random init of its 300M parameters, then
   every tensor was overwritten by the checkpoint; now it is built without (24.6 -> 20.6 s in
   that run). The rest of the gap to TRL's 7 s (imports, four 1.2 GB checkpoints loaded into
   Megatron modules, DDP buffers, the optimizers' state on the first step) is not pursued.

Looked at and left: the sampling itself (softmax, CDF and search over the vocabulary per
decode step) is ~1 % of the rollout; the hidden -> log-prob kernel with recompute
(``kernels/fused/hidden_logprobs.py``) is not on the training path: with ``output_positions`` the
actor materialises the logits of K response positions only (here 128 x 250,880 fp32, 128 MB a
micro-batch; at 176B with TP 8 and 1,024 response tokens a micro-batch, 1,024 x 31,360 bf16 =
64 MB), so there is no memory to buy back by recomputing, and computing the loss's upstream
gradient in the forward (no stored logits) was not needed for the target.

``--engines megatron vllm`` (issue 23) runs our train-ppo once per ``rollout.engine`` (no TRL
unless ``--trl-python``); the vLLM side's rollout includes its in-memory weight sync. Measured
(``--size 560m --engines megatron vllm --steps 3``, 3 reps x 2 seeds, idle 2-core VM):

    | side        | step (s)           | rollout         | scoring         | update          | peak RSS (GB) | start-up (s) |
    | megatron    | 12.4 / 13.8 / 18.5 | 4.5 / 5.3 / 8.5 | 2.2 / 2.5 / 3.1 | 5.5 / 5.8 / 6.9 | 12.41         | 12           |
    | vllm        | 13.0 / 16.1 / 17.9 | 4.1 / 5.3 / 5.9 | 3.8 / 4.4 / 5.2 | 5.2 / 6.4 / 6.8 | 16.49         | 24           |

megatron / vllm step, medians: 0.86x (per seed 0.87x, 0.88x). vLLM generates the 8 x 32 tokens
in ~2.3 s against our ~5.3 s, but its weight sync takes ~3 s a step in this process (vLLM's
layer-by-layer reload re-materialises and re-packs every layer) and ``old_logprobs=auto``
recomputes log pi_old with an actor forward (+1.9 s of scoring). Tiny (``--size tiny --steps
4``): 0.30 vs 0.39 s a step (0.78x; per seed 0.61x, 1.12x).

After the shard-to-shard sync (issue 35), with vLLM's own log-probs under a correction
(``--size 560m --engines megatron vllm --steps 2 --prompts-per-step 8 --new-tokens 128
--rollout-correction token_tis``, 3 reps x 2 seeds, idle 2-core VM, 2026-12-03):

    | side        | step (s)           | rollout            | of it sync      | scoring         | update             | peak RSS (GB) | start-up (s) |
    | megatron    | 37.7 / 39.9 / 49.3 | 14.8 / 17.1 / 22.9 | 0               | 6.9 / 7.0 / 7.8 | 15.8 / 16.3 / 18.6 | 13.25         | 8 / 10 / 19  |
    | vllm        | 28.3 / 31.2 / 34.1 | 6.6 / 8.8 / 9.6    | 0.9 / 2.5 / 3.1 | 5.9 / 6.4 / 7.7 | 15.5 / 16.1 / 16.9 | 16.68         | 20 / 22 / 25 |

megatron / vllm step, medians: 1.28x (per seed 1.22x, 1.42x). 77 % of the sync is vLLM's CPU
backend re-packing the tied LM head (README, "rollout engines").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PAD, EOS = 3, 2
MKL_ENV = ("MEGATRON_RLHF_CPU_LINEAR", "mkl")  # models/cpu_linear.py's switch (stdlib-only here)
PHASES = ("step", "rollout", "sync", "scoring", "update", "optimizer")


@dataclass(frozen=True)
class StepShape:
    """What one PPO step holds (the defaults: the TRL comparison's). Written beside the inputs
    (``shape.json``) so that the TRL worker, another process, reads the same."""

    prompts_per_step: int = 8
    prompt_tokens: int = 16
    new_tokens: int = 32
    micro_batch: int = 4
    rollout_correction: str = "none"
    bf16: bool = False
    """Both sides in bf16: ours ``train.bf16=true`` (on a CPU fp32 weights, bf16 products:
    models/precision.py), TRL ``bf16=True`` (accelerate's CPU autocast)."""


SIZES = {
    "560m": dict(vocab_size=250_880, hidden_size=1024, num_layers=4, num_heads=16),
    "tiny": dict(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4),
}


def build_inputs(root: Path, size: str, seed: int, steps: int, shape: StepShape) -> dict:
    """Random actor and reward BLOOMs (HF safetensors) and the prompts of every step."""
    import torch
    from transformers import BloomConfig, BloomForSequenceClassification

    from megatron_rlhf.data import write_prompt_dataset
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    arch = tiny_architecture(**SIZES[size])
    save_random_hf_bloom(root / "actor", arch, seed=seed)
    config = BloomConfig(**{**arch.to_hf_dict(), "num_labels": 1, "pad_token_id": PAD})
    torch.manual_seed(seed + 1)
    BloomForSequenceClassification(config).save_pretrained(root / "reward")
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(
        4,
        arch.vocab_size,
        (steps * shape.prompts_per_step, shape.prompt_tokens),
        generator=generator,
    ).tolist()
    write_prompt_dataset(
        root / "prompts", prompts, vocab_size=arch.vocab_size, eos_id=EOS, pad_id=PAD
    )
    (root / "trl_prompts.json").write_text(json.dumps(prompts))
    (root / "shape.json").write_text(json.dumps(asdict(shape)))
    return {"root": root, "seed": seed, "steps": steps, "shape": shape}


def ours_command(inputs: dict, output_dir: Path, engine: str = "megatron") -> list[str]:
    import yaml

    root, shape = inputs["root"], inputs["shape"]
    config = {
        "models": {
            "actor": str(root / "actor"),
            "critic": str(root / "reward"),
            "reward": str(root / "reward"),
            "reward_kind": "rm",
        },
        "data": {"prompts": str(root / "prompts"), "max_prompt_length": shape.prompt_tokens},
        "rollout": {
            "prompts_per_step": shape.prompts_per_step,
            "max_new_tokens": shape.new_tokens,
            "temperature": 1.0,
            "engine": engine,
        },
        "ppo": {
            "epochs": 1,
            "num_minibatches": 1,
            "rollout_correction": shape.rollout_correction,
            "kl": {"coef": 0.05, "estimator": "k1"},
        },
        "actor_optim": {"lr": 1.0e-6, "warmup_fraction": 0.0},
        "critic_optim": {"lr": 1.0e-6, "warmup_fraction": 0.0},
        "train": {
            "steps": inputs["steps"],
            "seed": inputs["seed"],
            "micro_batch_size": shape.micro_batch,
            "output_dir": str(output_dir),
            "save_interval": 10_000,
            "sample_interval": 10_000,
            "bf16": shape.bf16,
        },
    }
    path = output_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "megatron_rlhf", "train-ppo", "--config", str(path)]


def ours_steps(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {
            "step": r["time/step_s"],
            # with vLLM: the in-memory weight sync before the rollout, too
            "rollout": r["time/rollout_s"] + r.get("time/weight_sync_s", 0.0),
            "sync": r.get("rollout/sync_s", 0.0),
            "scoring": r["time/score_s"],
            "update": r["time/update_s"] + r.get("time/advantages_s", 0.0),
            # one optimizer step per role (1 epoch x 1 minibatch)
            "optimizer": r["actor/time/optimizer_s"] + r["critic/time/optimizer_s"],
        }
        for r in records
    ]


def trl_command(inputs: dict, output_dir: Path, trl_python: str) -> list[str]:
    return [
        trl_python, __file__, "--trl-worker", str(inputs["root"]), "--output", str(output_dir),
        "--steps", str(inputs["steps"]), "--seed", str(inputs["seed"]),
    ]  # fmt: skip


def trl_worker(root: Path, output_dir: Path, steps: int, seed: int) -> None:
    """One TRL PPOTrainer run, each step's phases appended to ``output_dir/steps.jsonl``."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    phases = {"rollout": 0.0, "scoring": 0.0, "optimizer": 0.0}

    def timed(function, phase_of):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phase = phase_of()
                if phase is not None:
                    phases[phase] += time.perf_counter() - start

        return wrapper

    scoring = lambda: None if torch.is_grad_enabled() else "scoring"  # noqa: E731
    trl_ppo.batch_generation = timed(trl_ppo.batch_generation, lambda: "rollout")
    trl_ppo.forward = timed(trl_ppo.forward, scoring)
    trl_ppo.get_reward = timed(trl_ppo.get_reward, scoring)

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            step = now - self.last
            update = step - phases["rollout"] - phases["scoring"]  # the optimizer's inside
            record = {"step": step, **phases, "update": update, "sync": 0.0}
            with open(output_dir / "steps.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            phases.update(rollout=0.0, scoring=0.0, optimizer=0.0)
            self.last = now

    output_dir.mkdir(parents=True, exist_ok=True)
    shape = StepShape(**json.loads((root / "shape.json").read_text()))
    words = {"<unk>": 0, "<s>": 1, "</s>": EOS, "<pad>": PAD}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")),
        pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>",
    )  # fmt: skip
    prompts = json.loads((root / "trl_prompts.json").read_text())
    dataset = Dataset.from_dict({"input_ids": prompts})
    policy = AutoModelForCausalLM.from_pretrained(root / "actor", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(root / "actor", dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(root / "reward", num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(root / "reward", num_labels=1)
    args = PPOConfig(
        output_dir=str(output_dir / "trl"),
        per_device_train_batch_size=shape.micro_batch,
        gradient_accumulation_steps=shape.prompts_per_step // shape.micro_batch,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=steps * shape.prompts_per_step,
        response_length=shape.new_tokens,
        temperature=1.0,
        kl_coef=0.05,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        gamma=1.0,
        lam=0.95,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        local_rollout_forward_batch_size=shape.prompts_per_step,
        num_sample_generations=0,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        seed=seed,
        use_cpu=True,
        bf16=shape.bf16,
        disable_tqdm=True,
        stop_token=None,
    )
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, ref_model=reference,
        reward_model=reward, value_model=value, train_dataset=dataset, callbacks=[StepTimer()],
    )  # fmt: skip
    optimizer = trainer.optimizer  # accelerate's: steps only when gradients are synced
    optimizer.step = timed(optimizer.step, lambda: "optimizer")
    trainer.train()


def run_side(
    command: list[str], steps_of, output_dir: Path, steps: int, threads: int, extra_env=None
) -> dict:
    """Launch one process, wait for its steps, return its timings and peak RSS."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.update(extra_env or {})
    log = open(output_dir.with_suffix(".log"), "w")
    launched = time.time()
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    while True:
        pid, _, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:  # exited by itself
            break
        if len(steps_of(output_dir)) >= steps:  # the last step is logged: skip the final save
            proc.kill()
            _, _, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.5)
    finished = time.time()
    log.close()
    records = steps_of(output_dir)
    if len(records) < steps:
        tail = output_dir.with_suffix(".log").read_text()[-3000:]
        raise SystemExit(f"{command[:4]} stopped after {len(records)} steps:\n{tail}")
    timed = records[1:steps]
    result = {phase: statistics.median(r[phase] for r in timed) for phase in PHASES}
    result["rss_gb"] = usage.ru_maxrss / 2**20  # KiB
    result["startup"] = finished - launched - sum(r["step"] for r in records[:steps])
    return result


def row(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", help="interpreter of a venv with trl installed")
    parser.add_argument("--size", choices=sorted(SIZES), default="560m")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=4, help="PPO steps per process (>= 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", help="keep inputs and logs here (default: a temp dir)")
    parser.add_argument(
        "--engines", nargs="+", choices=("megatron", "vllm"), default=["megatron"],
        help="our train-ppo once per rollout.engine (vllm: the vllm extra)",
    )  # fmt: skip
    defaults = StepShape()
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--micro-batch", type=int, default=defaults.micro_batch)
    parser.add_argument(
        "--rollout-correction", choices=("none", "token_tis", "seq_tis"), default="none",
        help="ppo.rollout_correction of our sides (with it on, old_logprobs=auto takes vLLM's "
        "own log-probs instead of recomputing them)",
    )  # fmt: skip
    parser.add_argument(
        "--roofline", action="store_true",
        help="after the runs, time this machine's products and print each side's phases "
        "beside their floors (benchmarks/roofline.py)",
    )  # fmt: skip
    parser.add_argument(
        "--bf16", action="store_true", help="both sides in bf16 (ours: train.bf16=true)"
    )
    parser.add_argument(
        "--mkl-side", action="store_true",
        help="also our train-ppo with its fp32 CPU products through MKL instead of oneDNN "
        f"({MKL_ENV[0]}={MKL_ENV[1]}: models/cpu_linear.py), interleaved with the others",
    )  # fmt: skip
    parser.add_argument(
        "--env-side", nargs=2, action="append", default=[], metavar=("NAME", "VAR=VALUE"),
        help="also our train-ppo as side 'ours (NAME)' with the environment variable VAR set to "
        "VALUE (e.g. onednn MEGATRON_RLHF_CPU_LINEAR=onednn: our few-row kernel off; several as "
        "VAR=VALUE,VAR2=VALUE2), interleaved with the others; repeatable",
    )  # fmt: skip
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(Path(args.trl_worker), Path(args.output), args.steps, args.seed)
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2: step 1 is a warm-up")
    if args.reps < 3 or len(args.seeds) < 2:
        parser.error("measure with >= 3 reps and >= 2 seeds")
    if args.prompts_per_step % args.micro_batch:
        parser.error("--prompts-per-step must be a multiple of --micro-batch")
    shape = StepShape(
        args.prompts_per_step, args.prompt_tokens, args.new_tokens, args.micro_batch,
        args.rollout_correction, args.bf16,
    )  # fmt: skip
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_ppo_"))
    engines = {"ours" if e == "megatron" else f"ours ({e})": e for e in args.engines}
    side_env = {}
    if args.mkl_side:
        engines["ours (MKL)"] = "megatron"
        side_env["ours (MKL)"] = dict([MKL_ENV])
    for name, setting in args.env_side:
        parts = setting.split(",")
        if not all("=" in part for part in parts):
            parser.error(f"--env-side {name} {setting}: the setting must read VAR=VALUE[,...]")
        engines[f"ours ({name})"] = "megatron"
        side_env[f"ours ({name})"] = dict(part.split("=", 1) for part in parts)
    sides = list(engines) + (["trl"] if args.trl_python else [])
    results = {side: {seed: [] for seed in args.seeds} for side in sides}
    for seed in args.seeds:
        inputs = build_inputs(work / f"seed{seed}", args.size, seed, args.steps, shape)
        for rep in range(args.reps):
            order = sides if rep % 2 == 0 else sides[::-1]
            for side in order:
                label = side.replace(" ", "_").replace("(", "").replace(")", "")
                output_dir = work / f"seed{seed}" / f"{label}_rep{rep}"
                if side in engines:
                    command = ours_command(inputs, output_dir, engines[side])
                    steps_of = ours_steps
                else:
                    command = trl_command(inputs, output_dir, args.trl_python)
                    steps_of = _trl_steps
                result = run_side(
                    command, steps_of, output_dir, args.steps, args.threads, side_env.get(side)
                )
                results[side][seed].append(result)
                print(f"seed {seed} rep {rep} {side}: " + json.dumps(
                    {k: round(v, 2) for k, v in result.items()}), flush=True)  # fmt: skip
    print(f"\n{args.size}: B={shape.prompts_per_step}, {shape.prompt_tokens} prompt + "
          f"{shape.new_tokens} new tokens, micro-batch {shape.micro_batch}, rollout_correction "
          f"{shape.rollout_correction}, {'bf16' if shape.bf16 else 'fp32'}, {args.threads} "
          "threads; min / median / max over "
          f"{args.reps} reps x {len(args.seeds)} seeds")  # fmt: skip
    print("| side | step (s) | rollout | of it sync | scoring | update | of it optimizer |"
          " peak RSS (GB) | start-up (s) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for side in sides:
        every = [r for seed in args.seeds for r in results[side][seed]]
        digits = ".2f" if args.size == "tiny" else ".1f"
        cells = [row([r[k] for r in every], digits) for k in PHASES]
        cells += [
            row([r["rss_gb"] for r in every], ".2f"),
            row([r["startup"] for r in every], ".0f"),
        ]
        print(f"| {side} | " + " | ".join(cells) + " |")
    if "ours" in sides and "ours (vllm)" in sides:
        _print_ratio(
            results, args.seeds, "ours", "ours (vllm)", "our step with megatron / with vLLM"
        )
    if "ours (MKL)" in sides:
        _print_ratio(results, args.seeds, "ours (MKL)", "ours", "our step with MKL / as built")
    for name, setting in args.env_side:
        label = f"our step with {setting} / as built"
        _print_ratio(results, args.seeds, f"ours ({name})", "ours", label)
    if "trl" in sides:
        per_seed = [
            statistics.median(r["step"] for r in results["trl"][seed])
            / statistics.median(r["step"] for r in results["ours"][seed])
            for seed in args.seeds
        ]
        ours = statistics.median(r["step"] for s in args.seeds for r in results["ours"][s])
        trl = statistics.median(r["step"] for s in args.seeds for r in results["trl"][s])
        print(f"\nTRL step / our step, medians: {trl / ours:.2f}x (per seed: "
              + ", ".join(f"{v:.2f}x" for v in per_seed) + ")")  # fmt: skip
    if args.roofline:
        _print_roofline(args, shape, sides, results, reusing=["ours", *side_env])
    print(f"inputs and logs: {work}")


def _print_roofline(
    args, shape: StepShape, sides: list[str], results: dict, reusing: list[str]
) -> None:
    """Each side's median phase times beside the floors of the work it must do (``reusing``:
    our sides with our own rollout engine, which reuse the rollout's log-probs in fp32)."""
    import roofline

    machine = roofline.Machine(args.threads)
    roofline.print_machine(machine, roofline.SIZES[args.size])
    for side in sides:
        every = [r for seed in args.seeds for r in results[side][seed]]
        measured = {k: statistics.median(r[k] for r in every) for k in PHASES}
        measured["update"] -= measured["optimizer"]  # the optimizer is its own phase there
        dims = (shape.prompts_per_step, shape.prompt_tokens, shape.new_tokens, shape.micro_batch)
        reuses = side in reusing and not shape.bf16
        roofline.print_side(machine, args.size, dims, side, reuses, shape.bf16, measured)


def _print_ratio(results: dict, seeds, slow: str, fast: str, label: str) -> None:
    """Ratio of the step-time medians ``slow / fast``, overall and per seed."""
    per_seed = [
        statistics.median(r["step"] for r in results[slow][seed])
        / statistics.median(r["step"] for r in results[fast][seed])
        for seed in seeds
    ]
    a = statistics.median(r["step"] for s in seeds for r in results[slow][s])
    b = statistics.median(r["step"] for s in seeds for r in results[fast][s])
    print(f"\n{label}, medians: {a / b:.2f}x (per seed: "
          + ", ".join(f"{v:.2f}x" for v in per_seed) + ")")  # fmt: skip


def _trl_steps(output_dir: Path) -> list[dict]:
    path = output_dir / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    main()
