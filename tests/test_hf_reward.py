"""A Hugging Face ``BloomForSequenceClassification`` directory as ``models.reward`` of train-ppo
(or ``score --load``): accepted (its score head is r) and scored exactly as transformers scores
it; other HF directories are refused with a message that says what is wrong."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.checkpoint.hf_io import hf_reward_outputs
from megatron_rlhf.models.bloom.tiny import tiny_architecture
from megatron_rlhf.utils import InputError

ARCH = tiny_architecture(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)
PAD = 3


def _hf_classifier(directory, num_labels: int, seed: int = 0):
    from transformers import BloomConfig, BloomForSequenceClassification

    config = BloomConfig(**{**ARCH.to_hf_dict(), "pad_token_id": PAD}, num_labels=num_labels)
    config.architectures = ["BloomForSequenceClassification"]
    torch.manual_seed(seed)
    model = BloomForSequenceClassification(config).eval()
    with torch.no_grad():  # non-trivial norms, biases and score head
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def test_hf_reward_model_scores_equal_transformers_logits(tmp_path):
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.distributed.pipeline import pipeline_forward
    from megatron_rlhf.reward.model import read_scalars

    hf = _hf_classifier(tmp_path / "rm", num_labels=1)
    assert hf_reward_outputs(tmp_path / "rm", "models.reward") == 1  # accepted
    generator = torch.Generator().manual_seed(1)
    lengths = [9, 4, 7, 1]  # ragged rows, right-padded as the PPO scorer pads them
    ids = torch.full((len(lengths), max(lengths)), PAD)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(4, ARCH.vocab_size, (length,), generator=generator)
        mask[row, :length] = 1
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits[:, 0].double()  # (B,)
    initialize()
    try:
        model = load_bloom(tmp_path / "rm", head="scalar", num_scalar_outputs=1).eval()
        with torch.no_grad():
            rewards, _ = read_scalars(pipeline_forward(model, ids, mask), mask, None)
    finally:
        destroy()
    torch.testing.assert_close(rewards.double(), expected, rtol=0, atol=2e-5)


def test_other_hf_directories_are_refused_with_the_reason(tmp_path):
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom

    save_random_hf_bloom(tmp_path / "lm", ARCH)
    with pytest.raises(InputError, match="BloomForCausalLM, not a reward model"):
        hf_reward_outputs(tmp_path / "lm", "models.reward")
    _hf_classifier(tmp_path / "two", num_labels=2)
    assert hf_reward_outputs(tmp_path / "two", "--load") == 2  # an AM exported by megatron-to-hf


def test_score_command_reads_an_hf_reward_model(tmp_path):
    import json

    from megatron_rlhf.reward.score import main as score

    hf = _hf_classifier(tmp_path / "rm", num_labels=1, seed=3)
    generator = torch.Generator().manual_seed(4)
    rows = [
        {"prompt_token_ids": torch.randint(4, 300, (p,), generator=generator).tolist(),
         "response_token_ids": torch.randint(4, 300, (r,), generator=generator).tolist()}
        for p, r in ((3, 5), (6, 1), (1, 8))
    ]  # fmt: skip
    source = tmp_path / "responses.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "scored.jsonl"
    assert (
        score(["--load", str(tmp_path / "rm"), "--input", str(source), "--output", str(out)]) == 0
    )
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    with torch.no_grad():
        for row, line in zip(rows, scored):
            ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
            assert line["reward"] == pytest.approx(float(hf(input_ids=ids).logits[0, 0]), abs=2e-5)
            assert line["score"] == line["reward"]  # an RM's score is r
