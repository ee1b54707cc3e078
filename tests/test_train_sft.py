"""``train-sft`` end to end on a tiny random BLOOM (single process; TP/PP parity is in
test_engine_parallel.py).

- The loss falls on learnable data (response = the prompt reversed); the run writes its
  resolved config, metrics.jsonl, TensorBoard events and latest_checkpoint.txt; the learning
  rate follows linear warm-up then cosine, checked against the closed form.
- A run killed by SIGKILL and relaunched repeats the uninterrupted run's losses bit for bit.
- ``tools/convert_checkpoint.py megatron-to-hf`` of its checkpoint gives a transformers
  ``BloomForCausalLM`` with the same logits on a ragged batch.
- Bad configs are refused with the key named.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrun_util import REPO

VOCAB = 96
STEPS = 10
LR, WARMUP_FRACTION, MIN_LR_RATIO = 4e-3, 0.2, 0.1
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def learnable_examples(count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Prompts of 2-6 tokens; the response is the prompt reversed (then EOS)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, 40, size=rng.integers(2, 7)).tolist() for _ in range(count)]
    return [(prompt, prompt[::-1]) for prompt in prompts]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_rlhf.data import write_sft_dataset
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    root = tmp_path_factory.mktemp("sft")
    save_random_hf_bloom(root / "hf", tiny_architecture(vocab_size=VOCAB), seed=0)
    for name, count, seed in (("train", 96, 0), ("eval", 16, 1)):
        write_sft_dataset(
            root / name, learnable_examples(count, seed), vocab_size=VOCAB, eos_id=2, pad_id=0
        )
    config = root / "sft.yaml"
    config.write_text(
        f"model:\n  load: {root / 'hf'}\n"
        f"data:\n  train: {root / 'train'}\n  eval: {root / 'eval'}\n"
        f"optim:\n  lr: {LR}\n  warmup_fraction: {WARMUP_FRACTION}\n"
        f"  min_lr_ratio: {MIN_LR_RATIO}\n"
        f"train:\n  global_batch_size: 16\n  micro_batch_size: 8\n  steps: {STEPS}\n"
        "  eval_interval: 5\n  save_interval: 4\n  log_interval: 1\n"
    )
    return {"root": root, "config": config}


def _metrics(run_dir: Path, timings: bool = False) -> dict[str, dict[int, float]]:
    """{"train/loss": {step: value}, ...} from metrics.jsonl (wall-clock figures only when
    ``timings``: they differ from run to run)."""
    series: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key != "step" and (
                timings or not key.startswith(("train/time/", "train/throughput/"))
            ):
                series.setdefault(key, {})[record["step"]] = value
    return series


@pytest.fixture(scope="module")
def reference(setup):
    """The uninterrupted run, in this process, with the subprocesses' thread count."""
    from megatron_rlhf.training.sft import main

    saved = {key: os.environ.get(key) for key in DIST_ENV}
    run_dir = setup["root"] / "reference"
    try:
        assert main(["--config", str(setup["config"]), f"train.output_dir={run_dir}"]) == 0
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})
    return run_dir


@pytest.mark.e2e
def test_loss_falls_and_run_writes_its_outputs(reference):
    series = _metrics(reference)
    losses = series["train/loss"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = np.mean([losses[s] for s in (1, 2)]), np.mean([losses[s] for s in (9, 10)])
    assert last < 0.9 * first, (first, last)
    assert series["eval/loss"][10] < series["eval/loss"][5]
    timings = _metrics(reference, timings=True)  # every step: wall time and end-to-end tokens/s
    for key in ("train/time/step_s", "train/throughput/tokens_per_s"):
        assert sorted(timings[key]) == list(range(1, STEPS + 1)) and min(timings[key].values()) > 0
    assert (reference / "latest_checkpoint.txt").read_text().strip() == f"step_{STEPS:07d}"
    checkpoint = reference / f"step_{STEPS:07d}"
    saved = json.loads((checkpoint / "megatron_rlhf.json").read_text())
    assert saved["config"] == json.loads((reference / "config.json").read_text())
    assert saved["head"] == "lm" and saved["eval"]["loss"] == series["eval/loss"][10]
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    # Megatron's scheduler logs the lr of the step just taken + 1: warm-up, then cosine.
    warmup = math.ceil(WARMUP_FRACTION * STEPS)
    for step, lr in series["train/lr"].items():
        if step <= warmup:
            expected = LR * step / warmup
        else:
            progress = (step - warmup) / (STEPS - warmup)
            expected = LR * (
                MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))
            )
        assert lr == pytest.approx(expected, rel=1e-9), step


@pytest.mark.chaos
def test_killed_run_resumes_exactly(setup, reference):
    """SIGKILL once a middle checkpoint exists, relaunch: every logged number equals the
    uninterrupted run's (the resumed run first drops metrics.jsonl lines after its checkpoint)."""
    run_dir = setup["root"] / "killed"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # same reductions as the reference
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for key in DIST_ENV:
        env.pop(key, None)
    command = [sys.executable, "-m", "megatron_rlhf", "train-sft", "--config",
               str(setup["config"]), f"train.output_dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    pointer, killed_after = run_dir / "latest_checkpoint.txt", None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if pointer.exists():
            step = int(pointer.read_text().strip().removeprefix("step_") or 0)
            if step in (4, 8):
                os.killpg(proc.pid, signal.SIGKILL)
                killed_after = step
                break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert len(_metrics(run_dir)["train/loss"]) < STEPS
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {pointer.parent / f'step_{killed_after:07d}'}" in resumed.stderr
    assert _metrics(run_dir) == _metrics(reference)


@pytest.mark.e2e
def test_hf_export_gives_the_same_logits(reference, tmp_path):
    from transformers import BloomForCausalLM

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.distributed import destroy, initialize

    checkpoint = reference / f"step_{STEPS:07d}"
    saved = {key: os.environ.get(key) for key in DIST_ENV}
    try:
        assert (
            convert(["megatron-to-hf", "--load", str(checkpoint), "--save", str(tmp_path / "hf")])
            == 0
        )
        initialize()
        model = load_bloom(checkpoint).eval()
        lengths = [7, 3, 5]
        generator = torch.Generator().manual_seed(9)
        ids = torch.randint(4, VOCAB, (3, 7), generator=generator)
        mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()  # right padding
        with torch.no_grad():
            ours = model(ids, mask)[..., :VOCAB]
        destroy()
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})
    hf = BloomForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert theirs[real].abs().max() > 1.0
    assert (ours - theirs)[real].abs().max().item() < 1e-4
    # the exported weights are the trained ones, not the initial HF model's
    initial = BloomForCausalLM.from_pretrained(str(reference.parent / "hf")).eval()
    with torch.no_grad():
        assert (initial(input_ids=ids, attention_mask=mask).logits - theirs)[
            real
        ].abs().max() > 1e-2


def test_bad_configs_are_named(setup, tmp_path, capsys):
    from megatron_rlhf.training.sft import main

    base = ["--config", str(setup["config"]), f"train.output_dir={tmp_path / 'run'}"]
    assert main([*base, "optim.lrr=1e-5"]) == 2
    assert "unknown config key optim.lrr; did you mean optim.lr?" in capsys.readouterr().err
    assert main([*base, "train.global_batch_size=12"]) == 2
    assert "train.global_batch_size=12 is not a multiple of train.micro_batch_size=8" in (
        capsys.readouterr().err
    )
    assert main([*base, "data.eval_fraction=0.1"]) == 2
    assert "give data.eval or data.eval_fraction, not both" in capsys.readouterr().err
    assert not (tmp_path / "run" / "latest_checkpoint.txt").exists()


def test_example_config_loads():
    from megatron_rlhf.config import load_config
    from megatron_rlhf.training.sft import SFTConfig

    config = load_config(SFTConfig, REPO / "examples/sft/tiny_cpu.yaml")
    assert config.train.bf16 == "auto" and config.train.global_batch_size % 16 == 0
