"""From a run to a result, nothing lost on the way (issue 10, items 1-5).

- Policy export: a train-ppo checkpoint exports its actor (HF ``generate``, greedy, gives our
  generation's tokens from the checkpoint) and its critic (HF sequence-classification score =
  our value at the last token); tests/test_ppo_training.py repeats it on a TP=2 checkpoint.
- One run lifecycle (training/run.py), the same in train-reward and train-ppo: at learning
  rate 1e6 both stop with exit code 2 and a one-line error naming the step, the last good
  checkpoint intact and ``latest`` pointing at it; a SIGTERM mid-run saves the step and exits
  75, and the resumed run logs each step once, equal to the uninterrupted run. Checkpoint
  saving itself refuses a non-finite tensor; ``score`` refuses to write NaN.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ppo_fixtures import VOCAB, make_ppo_setup
from test_reward_train import save_hf_bloom, write_synthetic_pairs


@pytest.fixture(scope="module")
def reward_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity_reward")
    return {
        "root": root,
        "data": write_synthetic_pairs(root / "pairs", pairs_per_task=10),
        "trunk": save_hf_bloom(root / "hf", num_outputs=None, seed=2),
    }


@pytest.fixture(scope="module")
def ppo_setup(tmp_path_factory):
    return make_ppo_setup(tmp_path_factory.mktemp("integrity_ppo"))


def reward_argv(setup, output: Path, *extra: str) -> list[str]:
    return [
        f"model.load={setup['trunk']}",
        f"data.train={setup['data']}",
        f"train.output_dir={output}",
        "optim.warmup_fraction=0",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        "train.eval_interval=0",
        "train.log_interval=1",
        *extra,
    ]


PPO_SHORT = [
    "rollout.prompts_per_step=8",
    "ppo.epochs=1",
    "ppo.num_minibatches=1",
    "train.micro_batch_size=8",
    "train.save_interval=1",
]


def assert_all_finite(checkpoint: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(checkpoint))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "size") and meta.properties.dtype.is_floating_point
    }
    torch.distributed.checkpoint.load(state, storage_reader=reader, no_dist=True)
    assert state and all(bool(torch.isfinite(t).all()) for t in state.values())


# ---------------------------------------------------------------- one run lifecycle: guard, signal, resume


def lifecycle_main(command: str):
    """The ``main(argv)`` of ``command`` (train-reward or train-ppo), run in this process."""
    from importlib import import_module

    module = {"train-reward": "reward.train", "train-ppo": "ppo.train_cli"}[command]
    return import_module(f"megatron_rlhf.{module}").main


def lifecycle_argv(command: str, request, run: Path, *extra: str) -> list[str]:
    """The arguments of the ``reward_run`` / ``ppo_run`` fixtures' runs in ``run``."""
    if command == "train-reward":
        setup = request.getfixturevalue("reward_setup")
        return reward_argv(setup, run, "optim.lr=1e-3", "train.save_interval=1", *extra)
    setup = request.getfixturevalue("ppo_setup")
    return ["--config", str(setup["config"]), f"train.output_dir={run}", *PPO_SHORT, *extra]


def is_wall_clock(key: str) -> bool:
    """A logged figure that differs from run to run: a time (``time/...``, ``..._s``,
    ``...seconds``) or a rate (``..._per_s``)."""
    return any(c in key for c in ("time", "per_s", "seconds")) or key.endswith("_s")


def logged(run: Path) -> list[dict]:
    """metrics.jsonl without wall-clock figures."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not is_wall_clock(k)} for row in rows]


@pytest.mark.parametrize("command", ["train-reward", "train-ppo"])
def test_a_nonfinite_step_stops_with_exit_2_and_keeps_the_last_good_checkpoint(
    command, request, tmp_path, capsys
):
    """training/run.py's guard, the same in both trainers: at learning rate 1e6 step 2 is
    non-finite; the run stops with one line naming it before anything of step 2 is saved."""
    run = tmp_path / "run"
    rates = ["optim.lr=1e6"] if command == "train-reward" else ["actor_optim.lr=1e6"]
    if command == "train-ppo":
        rates.append("critic_optim.lr=1e6")
    assert (
        lifecycle_main(command)(lifecycle_argv(command, request, run, *rates, "train.steps=4")) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    named = "(grad_norm=nan, loss=nan" if command == "train-reward" else "(actor/"
    assert err.startswith(f"{command}: error: step 2: non-finite loss or gradient norm {named}")
    assert "no checkpoint of this step was written" in err
    assert ("optim.lr" if command == "train-reward" else "actor_optim.lr, critic_optim.lr") in err
    assert (run / "latest_checkpoint.txt").read_text().strip() == "step_0000001"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_0000001"]
    assert [row["step"] for row in logged(run)] == [1]
    assert_all_finite(run / "step_0000001")


@pytest.mark.parametrize("command", ["train-reward", "train-ppo"])
def test_sigterm_saves_and_the_resumed_run_logs_each_step_once_as_if_uninterrupted(
    command, request, tmp_path, monkeypatch, capsys
):
    """training/run.py's save on a signal and resume, the same in both trainers: SIGTERM during
    step 1 (no checkpoint due) -> a checkpoint of step 1, exit 75; relaunched, step 2 is logged
    once and every logged number equals the uninterrupted run's (``reward_run`` / ``ppo_run``)."""
    import os
    import signal

    from megatron_rlhf.training.run import Run

    reference = request.getfixturevalue("reward_run" if command == "train-reward" else "ppo_run")
    run, end_step = tmp_path / "run", Run.end_step

    def signalled(self, step, *args):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # caught: recorded, the step finishes
        return end_step(self, step, *args)

    argv = lifecycle_argv(command, request, run, "train.steps=2", "train.save_interval=100")
    monkeypatch.setattr(Run, "end_step", signalled)
    assert lifecycle_main(command)(argv) == 75
    out, err = capsys.readouterr()
    assert sorted(p.name for p in run.glob("step_*")) == ["step_0000001"]
    assert (run / "latest_checkpoint.txt").read_text().strip() == "step_0000001"
    assert f"[{command}] stopped by SIGTERM after step 1; checkpoint {run / 'step_0000001'}" in err
    assert f"[{command}] done: " in out and out.rstrip().endswith("stopped_by=SIGTERM")
    monkeypatch.setattr(Run, "end_step", end_step)
    assert lifecycle_main(command)(argv) == 0
    assert f"[{command}] resumed from {run / 'step_0000001'} at step 1" in capsys.readouterr().err
    assert [row["step"] for row in logged(run)] == [1, 2]
    assert logged(run) == logged(reference)


def test_guard_skips_up_to_the_budget_then_names_the_step():
    from megatron_rlhf.training.guards import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard(max_skips=1)
    assert guard.check(1, {"loss": 0.5, "grad_norm": 1.0, "update_skipped": 0.0})
    assert guard.check(1, {"actor/loss": 0.5, "critic/explained_variance": math.nan})
    assert not guard.check(2, {"loss": math.nan, "grad_norm": math.nan, "update_skipped": 1.0})
    assert guard.state_dict() == {"skipped": 1}
    with pytest.raises(NonFiniteError, match=r"^step 5: .*\(grad_norm=inf\).*=1\)"):
        guard.check(5, {"loss": 0.1, "grad_norm": math.inf})


def test_checkpoint_save_refuses_a_nonfinite_tensor(tmp_path):
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.training.guards import NonFiniteError

    state = {"model": {"w": torch.ones(3), "b": torch.tensor([0.0, math.inf])}}
    with pytest.raises(NonFiniteError, match=r"step_0000009: refusing .* \(model\.b\)"):
        dist_ckpt.save(tmp_path / "step_0000009", state, {})
    assert list(tmp_path.iterdir()) == []


def test_score_refuses_to_write_nan(tmp_path, capsys):
    from megatron_rlhf.reward import score

    results = {0: (0.5, None, 0.5), 1: (math.nan, None, math.nan)}

    class Args:
        input, load, output = "pairs.jsonl", "ckpt", str(tmp_path / "out.jsonl")

    with pytest.raises(score.InputError, match=r"^pairs.jsonl: sequence 1 .*nothing was written"):
        score._refuse_nonfinite(results, Args)
    score._refuse_nonfinite({0: results[0]}, Args)


# ---------------------------------------------------------------- policy export


@pytest.fixture(scope="module")
def ppo_run(ppo_setup):
    """Two PPO steps at the fixture's learning rates, a checkpoint after each."""
    from megatron_rlhf.ppo.train_cli import main

    run = ppo_setup["root"] / "run"
    argv = ["--config", str(ppo_setup["config"]), f"train.output_dir={run}", *PPO_SHORT]
    assert main([*argv, "train.steps=2", "train.sample_interval=1"]) == 0
    return run


def check_export_matches_checkpoint(checkpoint: Path, work: Path) -> None:
    """Export actor and critic of a train-ppo checkpoint; the HF models behave like ours."""
    from safetensors.torch import load_file
    from transformers import BloomForCausalLM, BloomForSequenceClassification

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.generation.cli import main as generate
    from megatron_rlhf.generation.prompts import left_pad

    for role in ("actor", "critic"):
        argv = ["megatron-to-hf", "--load", str(checkpoint), "--save", str(work / role)]
        assert convert([*argv, "--role", role]) == 0
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(4, VOCAB, (int(length),), generator=generator).tolist()
        for length in torch.randint(2, 7, (6,), generator=generator)
    ]  # ragged: left padding
    (work / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts)
    )
    out = work / "ours.jsonl"
    argv = ["--load", str(checkpoint), "--prompts", str(work / "prompts.jsonl")]
    assert generate([*argv, "--output", str(out), "--greedy", "--max-new-tokens", "8"]) == 0
    ours = [json.loads(line)["response_token_ids"] for line in out.read_text().splitlines()]
    refilled = work / "refilled.jsonl"  # 6 prompts through 2 decode slots (continuous batching)
    argv += ["--output", str(refilled), "--greedy", "--max-new-tokens", "8", "--decode-batch", "2"]
    assert generate(argv) == 0
    lines = refilled.read_text().splitlines()
    assert [json.loads(line)["response_token_ids"] for line in lines] == ours
    input_ids, mask = left_pad(prompts, 3)
    hf = BloomForCausalLM.from_pretrained(work / "actor", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = hf.generate(
            input_ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
            eos_token_id=2, pad_token_id=3,
        )[:, input_ids.shape[1]:].tolist()  # fmt: skip
    theirs = [row[: row.index(2) + 1] if 2 in row else row for row in tokens]
    assert ours == theirs
    sequences = torch.randint(4, VOCAB, (3, 9), generator=generator)  # no pad id: last = end
    critic = BloomForSequenceClassification.from_pretrained(work / "critic").eval()
    initialize()
    try:
        model = load_bloom(checkpoint, head="scalar", num_scalar_outputs=1, init_weights=False)
        with torch.no_grad():
            values = model.eval()(sequences, torch.ones_like(sequences))[:, -1, 0]
            scores = critic(sequences).logits[:, 0]
    finally:
        destroy()
    # transformers' score head has no bias; the export keeps ours as score.bias beside it (as a
    # reward-model export does), which transformers reports as unexpected and leaves out
    bias = load_file(str(work / "critic" / "model-00001-of-00001.safetensors"))["score.bias"]
    torch.testing.assert_close(scores + bias, values, rtol=1e-5, atol=1e-5)


def test_ppo_policy_exports_to_hf_and_generates_identically(ppo_run, tmp_path):
    check_export_matches_checkpoint(ppo_run / "step_0000002", tmp_path)


# ---------------------------------------------------------------- trusted loading


@pytest.fixture(scope="module")
def reward_run(reward_setup):
    """Two train-reward steps, a checkpoint after each."""
    from megatron_rlhf.reward.train import main

    run = reward_setup["root"] / "run"
    argv = reward_argv(reward_setup, run, "optim.lr=1e-3", "train.save_interval=1")
    assert main([*argv, "train.steps=2"]) == 0
    return run


def copy_run(run: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(run, target)
    return target


def test_checkpoints_hold_json_rank_state_and_a_manifest_of_every_file(reward_run):
    from megatron_rlhf.checkpoint.manifest import sha256_of

    checkpoint = reward_run / "step_0000002"
    assert [p.name for p in (checkpoint / "rank_state").iterdir()] == ["00000.json"]
    state = json.loads((checkpoint / "rank_state" / "00000.json").read_text())
    assert state["trainer"]["step"] == 2 and len(state["rng"]["torch"]) > 0
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    on_disk = {
        str(p.relative_to(checkpoint))
        for p in checkpoint.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert set(files) == on_disk and ".metadata" in files and "common.pt" in files
    for name, entry in files.items():
        assert entry["size"] == (checkpoint / name).stat().st_size
        assert entry["sha256"] == sha256_of(checkpoint / name)


class _Payload:
    """Unpickling this creates a file: proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_tampered_checkpoint_is_refused_before_anything_is_unpickled(reward_run, tmp_path):
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint import manifest
    from megatron_rlhf.checkpoint.safe_pickle import UnsafeCheckpointError
    from megatron_rlhf.utils import InputError

    checkpoint = copy_run(reward_run / "step_0000002", tmp_path / "step_0000002")
    marker = tmp_path / "pickle_ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(InputError, match=r"step_0000002/\.metadata: \d+ bytes, \d+ expected"):
        dist_ckpt.load(checkpoint, {})
    assert not marker.exists()
    # torch's own reader is restricted too (checkpoint/safe_pickle.py): the payload never runs
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refers to pathlib\.Path\.touch"):
        FileSystemReader(str(checkpoint)).read_metadata()
    assert not marker.exists()

    swapped = copy_run(reward_run / "step_0000002", tmp_path / "swapped")
    first, second = swapped / "__0_0.distcp", swapped / "__0_1.distcp"
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b[: len(a)].ljust(len(a), b"\0"))  # same size, other content
    with pytest.raises(InputError, match=r"swapped/__0_0\.distcp: content differs from its SHA"):
        manifest.verify(swapped)
    (swapped / "common.pt").write_bytes((swapped / "common.pt").read_bytes()[:-1])
    with pytest.raises(InputError, match=r"common\.pt: \d+ bytes, \d+ expected \(truncated"):
        manifest.verify(swapped)
    assert not b == a  # the two shards really differ


def test_latest_pointer_must_name_a_checkpoint_inside_the_run(reward_setup, tmp_path, capsys):
    from megatron_rlhf.reward.train import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "latest_checkpoint.txt").write_text("../../etc\n")
    assert main(reward_argv(reward_setup, run, "train.steps=1")) == 2
    err = capsys.readouterr().err
    assert "latest_checkpoint.txt: names '../../etc', not a step_N directory of this run" in err


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(
    reward_setup, reward_run, tmp_path, capsys
):
    from megatron_rlhf.reward.train import main

    run = copy_run(reward_run, tmp_path / "run")
    shard = run / "step_0000002" / "__0_1.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert (
        main(
            reward_argv(
                reward_setup, run, "optim.lr=1e-3", "train.save_interval=1", "train.steps=3"
            )
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "step_0000002/__0_1.distcp:" in err and "(truncated or swapped)" in err
    assert f"[resume] falling back to {run / 'step_0000001'}" in err
    assert f"resumed from {run / 'step_0000001'} at step 1" in err
    assert (run / "latest_checkpoint.txt").read_text().strip() == "step_0000003"


# ---------------------------------------------------------------- run-directory discipline


def test_resume_refuses_a_changed_config_unless_forced_and_logs_changes(
    reward_setup, reward_run, tmp_path, capsys
):
    from megatron_rlhf.reward.train import main

    run = copy_run(reward_run, tmp_path / "run")
    argv = reward_argv(reward_setup, run, "train.save_interval=1", "train.steps=3")
    assert main([*argv, "optim.lr=2e-3"]) == 2
    err = capsys.readouterr().err
    assert "resuming with a changed config (optim.lr)" in err and "--force-config-change" in err
    assert (run / "latest_checkpoint.txt").read_text().strip() == "step_0000002"
    assert main([*argv, "optim.lr=2e-3", "--force-config-change"]) == 0
    assert "optim.lr: 0.001 -> 0.002" in capsys.readouterr().err
    changes = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert len(changes) == 1 and changes[0]["step"] == 2 and changes[0]["forced"] is True
    assert changes[0]["changes"]["optim.lr"] == [0.001, 0.002]
    assert set(changes[0]["changes"]) == {"optim.lr", "train.steps", "train.output_dir"}
    assert main([*argv, "optim.lr=2e-3", "train.steps=4", "train.resume=false"]) == 2
    assert (
        "already holds checkpoints (step_0000003) and train.resume=false" in capsys.readouterr().err
    )
    assert main([*argv, "optim.lr=2e-3", "train.steps=1", "train.resume=false", "--overwrite"]) == 0
    assert sorted(p.name for p in run.glob("step_*")) == ["step_0000001"]
    assert not (run / "config_changes.jsonl").exists()


def test_resumed_ppo_logs_each_step_once_and_reports_the_real_first_reward(
    ppo_setup, ppo_run, tmp_path, capsys
):
    import shutil

    from megatron_rlhf.ppo.train_cli import main

    original = [json.loads(line) for line in (ppo_run / "metrics.jsonl").read_text().splitlines()]
    run = copy_run(ppo_run, tmp_path / "run")  # as if killed after step 2's logs, before its save
    shutil.rmtree(run / "step_0000002")
    (run / "latest_checkpoint.txt").write_text("step_0000001\n")
    argv = ["--config", str(ppo_setup["config"]), f"train.output_dir={run}", *PPO_SHORT]
    assert main([*argv, "train.steps=3", "train.sample_interval=1"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[1]["reward/mean"] == original[1]["reward/mean"]  # step 2 redone exactly
    samples = [
        json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()
    ]
    assert sorted(set(samples)) == [1, 2, 3] and samples == sorted(samples)
    assert samples.count(2) == samples.count(1)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"first_reward={original[0]['reward/mean']:.4g} " in summary


# ---------------------------------------------------------------- tokenizer identity


def test_tokenizer_fingerprints_tell_tokenizers_apart(tmp_path):
    from megatron_rlhf.data import train_tiny_tokenizer
    from megatron_rlhf.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    texts_a = ["the cat sat on the mat"] * 20 + ["a dog ran in the park"] * 20
    texts_b = ["def f(x): return x + 1"] * 20 + ["for i in range(10): print(i)"] * 20
    a1 = train_tiny_tokenizer(texts_a, tmp_path / "a1", vocab_size=300)
    a2 = train_tiny_tokenizer(texts_a, tmp_path / "a2", vocab_size=300)
    b = train_tiny_tokenizer(texts_b, tmp_path / "b", vocab_size=300)
    fingerprints = [tokenizer_fingerprint(load_tokenizer(d)) for d in (a1, a2, b)]
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    assert fingerprints[0].startswith("sha256:") and len(fingerprints[0]) == 23


def test_data_from_another_tokenizer_is_refused_naming_both(reward_setup, tmp_path, capsys):
    from megatron_rlhf.data import Example, train_tiny_tokenizer, write_preference_dataset
    from megatron_rlhf.reward.train import main

    model_tokenizer = train_tiny_tokenizer(None, tmp_path / "model_tok", vocab_size=400)
    data_tokenizer = train_tiny_tokenizer(["x y z"] * 50, tmp_path / "data_tok", vocab_size=400)
    trunk = save_hf_bloom(tmp_path / "hf", num_outputs=None, seed=2, tokenizer=model_tokenizer)
    examples = [Example([40, 41], ([2, 3], [10, 11])) for _ in range(8)]
    write_preference_dataset(tmp_path / "other", examples, tokenizer_dir=data_tokenizer)
    argv = reward_argv({"trunk": trunk, "data": tmp_path / "other"}, tmp_path / "run")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"data.train ({tmp_path / 'other'}) uses tokenizer {data_tokenizer}" in err
    assert f"but the model {trunk} uses {trunk}" in err and "preprocess the data" in err
    write_preference_dataset(tmp_path / "big", examples, vocab_size=1024, append_eos=False)
    argv = reward_argv({"trunk": trunk, "data": tmp_path / "big"}, tmp_path / "run")
    assert main(argv) == 2
    assert "1024-token vocabulary, larger than the model's 512" in capsys.readouterr().err
    from megatron_rlhf.generation.cli import main as generate

    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n')
    argv = ["--load", str(trunk), "--tokenizer", str(data_tokenizer), "--prompts"]
    assert generate([*argv, str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {data_tokenizer} uses tokenizer {data_tokenizer} (sha256:" in err
    assert f"but {trunk} uses {trunk} (sha256:" in err
    old = write_synthetic_pairs(tmp_path / "old", pairs_per_task=2)  # no fingerprint recorded
    argv = reward_argv({"trunk": trunk, "data": old}, tmp_path / "run_old", "train.steps=1")
    assert main(argv) == 0
    assert "records no tokenizer fingerprint" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_is_the_elementwise_check(dtype):
    """``all_finite`` (one summing pass, the elementwise check when the sum is not finite)
    agrees with ``torch.isfinite(t).all()``: a NaN, either infinity, both together (a NaN
    sum), finite values whose sum overflows the dtype, an empty tensor, a strided view."""
    from megatron_rlhf.checkpoint.dist import all_finite

    big = torch.finfo(dtype).max
    cases = [
        torch.randn(1000, dtype=torch.float64).to(dtype),
        torch.tensor([1.0, math.nan, 2.0]),
        torch.tensor([1.0, math.inf]),
        torch.tensor([-math.inf, 3.0]),
        torch.tensor([math.inf, -math.inf, 1.0]),
        torch.tensor([big, big, -1.0], dtype=dtype),  # finite, but the sum overflows
        torch.tensor([]),
        torch.arange(24.0).reshape(4, 6).t()[::2],
    ]
    for case in cases:
        case = case.to(dtype)
        assert all_finite(case) == bool(torch.isfinite(case).all()), case
    assert not math.isfinite(float(torch.tensor([big, big], dtype=dtype).sum()))  # fallback ran
    assert all_finite(torch.tensor([big, big], dtype=dtype))
