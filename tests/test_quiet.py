"""A quiet first run (issue 34, item 7): the model every command builds and the distributed
checkpoints every command saves and loads raise none of the third-party warnings Python shows by
default (Megatron-Core's "full scope is deprecated", torch's ShardedTensor and ``load_state_dict``
FutureWarnings; DeprecationWarnings are hidden outside ``__main__``), and
eval-policy's one-line summary names its judge and speaks in the report's percent."""

from __future__ import annotations

import warnings

from megatron_rlhf.models.bloom.tiny import tiny_architecture

ARCH = tiny_architecture(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4)


def test_building_saving_and_loading_a_model_warns_nothing(tmp_path):
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.models.bloom import BloomModel

    initialize()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = BloomModel(ARCH, head="lm")
            saved = dist_ckpt.save(
                tmp_path / "ckpt", model.sharded_state_dict(), dist_ckpt.model_metadata(model)
            )
            dist_ckpt.load(saved, model.sharded_state_dict())
    finally:
        destroy()
    shown = [w for w in caught if issubclass(w.category, (FutureWarning, UserWarning))]
    assert [f"{w.category.__name__}: {w.message} ({w.filename})" for w in shown] == []


def test_eval_policy_summary_names_the_judge_in_percent():
    from megatron_rlhf.ppo.evaluate_report import summary_fields

    row = {"win_rate": 0.5, "tie_rate": 1 / 6, "lose_rate": 1 / 3, "net_win_rate": 1 / 6}
    report = {"settings": {"judge": "runs/am", "judge_kind": "am"}, "sets": {"main": row}}
    assert summary_fields(report) == {
        "judge": "runs/am",
        "judge_kind": "am",
        "main_win_tie_lose_pct": "50.0/16.7/33.3",
        "main_net_win_pct": "+16.7",
    }
