"""``tools/convert_checkpoint.py`` both ways, its refusals, and ``generate`` end to end.

HF -> Megatron at TP2xPP2 (the command relaunches itself under torchrun) -> HF with --pp 2 must
give back every tensor bit for bit. Bad inputs must be refused with a message that names the
problem, before anything is written: no --save directory and no ``*.tmp-partial`` beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_bloom_common import ARCH_B, PAD_ID, hf_greedy, save_hf_bloom
from safetensors import safe_open
from safetensors.torch import save_file
from torchrun_util import REPO

from megatron_rlhf.checkpoint import convert
from megatron_rlhf.models.bloom.config import BloomArchitecture

CONVERT = str(REPO / "tools" / "convert_checkpoint.py")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A stable reward model ranks the chosen response above the rejected one.",
    "Hello world, hello BLOOM! Selective rehearsal keeps old skills.",
] * 4


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MASTER_PORT", None)
    return env


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=_env(), cwd=REPO, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = handle.get_tensor(name)
    return tensors


def _tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    from megatron_rlhf.data.tokenizer import train_tiny_tokenizer

    return train_tiny_tokenizer(TEXTS, directory, vocab_size=vocab_size, min_frequency=1)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A bf16 HF BLOOM (as BigScience's releases) with a tokenizer, converted to Megatron at
    TP2xPP2 (fp32 parameters) and back with --pp 2."""
    root = tmp_path_factory.mktemp("convert")
    hf_dir, mc_dir, back_dir = root / "hf", root / "mc_tp2pp2", root / "hf_back"
    save_hf_bloom(hf_dir, ARCH_B, seed=2, dtype=torch.bfloat16)
    _tokenizer(hf_dir)
    to_mcore = _run(
        CONVERT, "hf-to-megatron", "--load", str(hf_dir), "--save", str(mc_dir),
        "--tp", "2", "--pp", "2",
    )  # fmt: skip
    assert to_mcore.returncode == 0, to_mcore.stdout[-3000:] + to_mcore.stderr[-6000:]
    to_hf = _run(
        CONVERT, "megatron-to-hf", "--load", str(mc_dir), "--save", str(back_dir), "--pp", "2"
    )
    assert to_hf.returncode == 0, to_hf.stdout[-3000:] + to_hf.stderr[-6000:]
    return dict(root=root, hf=hf_dir, mc=mc_dir, back=back_dir, logs=to_mcore.stdout + to_hf.stdout)


@pytest.mark.e2e(ranks=4)
def test_round_trip_is_bit_exact_for_every_tensor(converted):
    original, back = _tensors(converted["hf"]), _tensors(converted["back"])
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert tensor.dtype == back[name].dtype == torch.bfloat16, name
        assert torch.equal(back[name], tensor), name
    index = json.loads((converted["back"] / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    config = json.loads((converted["back"] / "config.json").read_text())
    assert BloomArchitecture.from_hf(config) == ARCH_B and config["torch_dtype"] == "bfloat16"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (converted["back"] / name).read_bytes() == (converted["hf"] / name).read_bytes()
    assert "[hf-to-megatron] done:" in converted["logs"]
    assert "[megatron-to-hf] done:" in converted["logs"]
    assert not list(converted["root"].glob("*.tmp-partial"))


@pytest.mark.e2e(ranks=4)
def test_transformers_loads_the_exported_model_unchanged(converted):
    from transformers import BloomForCausalLM

    ids = torch.randint(4, ARCH_B.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = BloomForCausalLM.from_pretrained(converted["hf"]).eval()(ids).logits
        after = BloomForCausalLM.from_pretrained(converted["back"]).eval()(ids).logits
    assert torch.equal(before, after)


@pytest.mark.e2e(ranks=4)
def test_megatron_checkpoint_records_what_it_holds(converted):
    meta = json.loads((converted["mc"] / "megatron_rlhf.json").read_text())
    assert BloomArchitecture(**meta["architecture"]) == ARCH_B
    assert meta["dtype"] == "float32" and meta["hf_dtype"] == "bfloat16"
    assert meta["head"] == "lm" and meta["padded_vocab_size"] == 1024
    assert (converted["mc"] / "tokenizer.json").exists()


@pytest.mark.e2e(ranks=4)
def test_generate_cli_end_to_end(converted, tmp_path):
    """Text and token-id prompts through `python -m megatron_rlhf generate` on the TP2xPP2
    checkpoint (loaded at TP1): fields kept in order, greedy tokens as transformers'."""
    from transformers import AutoTokenizer, BloomForCausalLM

    records = [
        {"id": "a", "prompt": "The quick brown fox", "extra": [1, 2]},
        {"id": "b", "prompt_token_ids": [40, 41, 42, 43, 44, 45, 46, 47]},
        {"id": "c", "prompt": "Hello"},
    ]
    prompts, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = _run(
        "-m", "megatron_rlhf", "generate", "--load", str(converted["mc"]),
        "--prompts", str(prompts), "--output", str(output), "--max-new-tokens", "6",
        "--greedy", "--output-logprobs",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "[generate] done:" in run.stdout
    lines = [json.loads(line) for line in output.read_text().splitlines()]

    tokenizer = AutoTokenizer.from_pretrained(converted["mc"])
    prompt_ids = [
        r.get("prompt_token_ids") or tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        for r in records
    ]
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(records), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
    hf = BloomForCausalLM.from_pretrained(converted["hf"], dtype=torch.float32).eval()
    ref_tokens, ref_logprobs = hf_greedy(hf, ids, mask, max_new_tokens=6)

    assert len(lines) == len(records)
    for row, (record, line) in enumerate(zip(records, lines)):
        assert list(line)[: len(record)] == list(record) and all(
            line[k] == v for k, v in record.items()
        )
        assert {"response", "response_token_ids", "response_logprobs"} <= set(line)
        length = len(line["response_token_ids"])
        assert line["response_token_ids"] == ref_tokens[row, :length].tolist()
        assert length == 6 or line["response_token_ids"][-1] == tokenizer.eos_token_id
        # finished: stopped by EOS (the reference's own token), not by --max-new-tokens
        assert line["finished"] == (ref_tokens[row, length - 1].item() == tokenizer.eos_token_id)
        assert line["response"] == tokenizer.decode(
            line["response_token_ids"], skip_special_tokens=True
        )
        diff = (torch.tensor(line["response_logprobs"]) - ref_logprobs[row, :length]).abs().max()
        assert diff <= 1e-4, (row, diff)


@pytest.mark.e2e(ranks=4)
def test_megatron_to_hf_refuses_a_launch_of_the_wrong_size(
    converted, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["megatron-to-hf", "--load", str(converted["mc"]), "--save", str(tmp_path / "out")]
    _refused(capsys, tmp_path, argv, "launched with 2 processes", "exactly --pp = 1")


# ---- refusals: a clear message and nothing written ----


@pytest.fixture(scope="module")
def hf_small(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad") / "hf"
    save_hf_bloom(directory, ARCH_B, seed=3)
    return directory


def _variant(hf_small: Path, tmp_path: Path, edit=None) -> Path:
    """A copy of the small HF checkpoint whose tensors ``edit(dict)`` changes in place."""
    directory = tmp_path / "hf_variant"
    shutil.copytree(hf_small, directory)
    if edit is not None:
        tensors = _tensors(directory)
        edit(tensors)
        save_file(tensors, directory / "model.safetensors", {"format": "pt"})
    return directory


def _refused(capsys, tmp_path: Path, argv: list[str], *fragments: str) -> None:
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()  # drop what building the input printed
    assert convert.main(argv) == 2
    message = capsys.readouterr().err
    assert message.startswith(f"{argv[0]}: error: ") and message.count("\n") == 1, message
    for fragment in fragments:
        assert fragment in message, message
    assert sorted(tmp_path.rglob("*")) == before, "a refused conversion wrote something"


def _to_mcore(load: Path, save: Path, *extra: str) -> list[str]:
    return ["hf-to-megatron", "--load", str(load), "--save", str(save), *extra]


@pytest.mark.launch
def test_cli_refuses_a_layout_that_does_not_divide_the_model(hf_small, tmp_path):
    save = tmp_path / "out"
    run = _run(CONVERT, *_to_mcore(hf_small, save, "--tp", "5", "--pp", "3"), timeout=120)
    assert run.returncode == 2, run.stderr
    assert "parallel: num_heads 12 is not divisible by tp=5: pick parallel.tp" in run.stderr
    assert "parallel: num_layers 2 is not divisible by pp=3: pick parallel.pp" in run.stderr
    assert not save.exists() and not list(tmp_path.glob("*tmp-partial*"))


def test_refuses_unknown_tensor(hf_small, tmp_path, capsys):
    def add(tensors):
        tensors["transformer.h.0.self_attention.rotary.inv_freq"] = torch.ones(4)

    load = _variant(hf_small, tmp_path, add)
    _refused(capsys, tmp_path, _to_mcore(load, tmp_path / "out"), "unknown tensors", "rotary")


def test_refuses_missing_tensor(hf_small, tmp_path, capsys):
    def drop(tensors):
        del tensors["transformer.h.1.mlp.dense_4h_to_h.bias"]

    load = _variant(hf_small, tmp_path, drop)
    _refused(capsys, tmp_path, _to_mcore(load, tmp_path / "out"), "missing tensors", "h.1.mlp")


def test_refuses_missing_shard(hf_small, tmp_path, capsys):
    from transformers import BloomForCausalLM

    load = tmp_path / "sharded"
    BloomForCausalLM.from_pretrained(hf_small).save_pretrained(load, max_shard_size="100KB")
    index = json.loads((load / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (load / shards[-1]).unlink()
    _refused(capsys, tmp_path, _to_mcore(load, tmp_path / "out"), f"lists shard {shards[-1]}")


def test_refuses_tokenizer_larger_than_the_vocab(tmp_path, capsys):
    arch = BloomArchitecture(vocab_size=250, hidden_size=24, num_layers=2, num_heads=3)
    load = tmp_path / "hf"
    save_hf_bloom(load, arch)
    _tokenizer(load, vocab_size=300)
    _refused(capsys, tmp_path, _to_mcore(load, tmp_path / "out"), "does not fit", "vocab_size 250")


def test_refuses_embedding_rows_that_disagree_with_config(hf_small, tmp_path, capsys):
    def shrink(tensors):
        name = "transformer.word_embeddings.weight"
        tensors[name] = tensors[name][:900].clone()

    load = _variant(hf_small, tmp_path, shrink)
    _refused(capsys, tmp_path, _to_mcore(load, tmp_path / "out"), "word_embeddings", "1000")


def test_refuses_existing_save_directory(hf_small, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    _refused(capsys, tmp_path, _to_mcore(hf_small, tmp_path / "out"), "already exists")


def test_megatron_to_hf_refuses_a_directory_that_is_not_a_checkpoint(hf_small, tmp_path, capsys):
    argv = ["megatron-to-hf", "--load", str(hf_small), "--save", str(tmp_path / "out")]
    _refused(capsys, tmp_path, argv, "not a megatron-rlhf checkpoint")
