"""tools/preprocess_data.py: files read back by Megatron-Core's own IndexedDataset, bad input,
--skip-bad, truncation, worker-count independence, HH-RLHF transcripts, other input formats.

Every expected token list comes from the Hugging Face tokenizer called on one text at a time
(``AutoTokenizer(...)(text, add_special_tokens=False)``), never from the tool's batched path.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rlhf.data import english_sentences, split_hh_pair, train_tiny_tokenizer
from megatron_rlhf.data.preprocess import main as preprocess_main
from megatron_rlhf.data.records import BadRecord
from megatron_rlhf.utils import write_jsonl

REPO = Path(__file__).resolve().parents[1]
PIECES = [
    "a",
    "b",
    "the",
    " ",
    "  ",
    "\n",
    "\t",
    ",",
    ".",
    "?",
    "é",
    "ß",
    "中文",
    "😀",
    "🇫🇷",
    "e\u0301",
    "\u200b",
    "\u2028",
    "\\",
    '"',
    "</s>",
    "<pad>",
    "Human:",
    "{}",
    "'",
    "42",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    return train_tiny_tokenizer(english_sentences(3000, seed=1), path, vocab_size=700)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def random_text(rng: random.Random, max_pieces: int = 40) -> str:
    """Awkward text: unicode, combining marks, line separators, literal special tokens."""
    if rng.random() < 0.05:
        return " ".join(english_sentences(rng.randint(30, 60), seed=rng.randint(0, 9999)))
    words = [
        rng.choice(PIECES) if rng.random() < 0.4 else rng.choice(english_sentences(1))
        for _ in range(rng.randint(1, max_pieces))
    ]
    return "".join(words)


def nonblank(rng: random.Random) -> str:
    text = random_text(rng)
    return text if text.strip() else text + "x"


def random_records(kind: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        if kind == "prompt":
            records.append({"prompt": nonblank(rng)})
        elif kind == "sft":
            prompt = "" if rng.random() < 0.1 else random_text(rng)
            records.append({"prompt": prompt, "response": nonblank(rng)})
        else:
            records.append(
                {
                    "prompt": nonblank(rng),
                    "chosen": nonblank(rng),
                    "rejected": nonblank(rng),
                    "task": rng.choice(["a", "b", 7]),
                }
            )
    return records


def run(
    tmp: Path, records_or_lines, kind: str, tokenizer_dir: Path, *extra: str, name: str = "out"
) -> tuple[int, str]:
    """Write the input (records or raw byte lines), run the tool in-process; (rc, prefix)."""
    src = tmp / f"{name}.jsonl"
    if records_or_lines and isinstance(records_or_lines[0], bytes):
        src.write_bytes(b"".join(records_or_lines))
    else:
        write_jsonl(src, records_or_lines)
    prefix = str(tmp / "out" / name)
    argv = [
        "--input",
        str(src),
        "--kind",
        kind,
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        prefix,
        "--no-progress",
        *extra,
    ]
    return preprocess_main(argv), prefix


def read_stream(prefix: str) -> list[list]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tiny_tokenizer_is_a_bloom_like_hf_tokenizer(tokenizer_dir, hf_tokenizer):
    tok = hf_tokenizer
    assert [tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id] == [0, 1, 2, 3]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
    assert tok.padding_side == "left"
    rng = random.Random(0)
    for _ in range(50):
        text = random_text(rng).replace("</s>", "").replace("<pad>", "")
        encoded = tok.encode(text)
        assert encoded == ids(tok, text)
        assert 0 not in encoded
        assert tok.decode(encoded) == text


@pytest.mark.parametrize("kind", ["prompt", "sft", "preference"])
def test_round_trip_through_megatron_indexed_dataset(tmp_path, tokenizer_dir, hf_tokenizer, kind):
    records = random_records(kind, 150, seed={"prompt": 1, "sft": 2, "preference": 3}[kind])
    rc, prefix = run(tmp_path, records, kind, tokenizer_dir)
    assert rc == 0
    tok, eos = hf_tokenizer, hf_tokenizer.eos_token_id
    sidecar = json.loads(Path(prefix + ".json").read_text())
    assert sidecar["kind"] == kind and sidecar["num_documents"] == len(records)
    assert sidecar["tokenizer"]["vocab_size"] == len(tok)
    assert (sidecar["tokenizer"]["eos_id"], sidecar["tokenizer"]["pad_id"]) == (2, 3)
    if kind == "prompt":
        assert read_stream(prefix) == [ids(tok, r["prompt"]) for r in records]
        assert sidecar["streams"]["tokens"]["dtype"] == "uint16"
    elif kind == "sft":
        prompts = [ids(tok, r["prompt"]) for r in records]
        responses = [ids(tok, r["response"]) + [eos] for r in records]
        assert read_stream(prefix) == [p + r for p, r in zip(prompts, responses)]
        masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses)]
        assert read_stream(prefix + "_loss_mask") == masks
        assert sidecar["streams"]["loss_mask"]["dtype"] == "uint8"
        assert sidecar["streams"]["tokens"]["num_values"] == sum(map(len, masks))
    else:
        assert read_stream(prefix + "_prompt") == [ids(tok, r["prompt"]) for r in records]
        for side in ("chosen", "rejected"):
            assert read_stream(f"{prefix}_{side}") == [ids(tok, r[side]) + [eos] for r in records]
        names = sidecar["tasks"]
        assert [names[t[0]] for t in read_stream(prefix + "_task")] == [
            str(r["task"]) for r in records
        ]
        assert sidecar["num_behaviour_policies"] == 0


def test_token_dtype_follows_vocab_size(tmp_path):
    from megatron_rlhf.data import write_prompt_dataset

    rng = np.random.default_rng(0)
    for vocab, dtype in ((65_499, np.uint16), (65_500, np.int32), (250_880, np.int32)):
        prompts = [rng.integers(0, vocab, rng.integers(1, 9)).tolist() for _ in range(5)]
        prompts[0][0] = vocab - 1
        sidecar = write_prompt_dataset(tmp_path / f"v{vocab}", prompts, vocab_size=vocab)
        assert sidecar["streams"]["tokens"]["dtype"] == np.dtype(dtype).name
        assert read_stream(str(tmp_path / f"v{vocab}")) == prompts
    with pytest.raises(ValueError, match="out of range"):
        write_prompt_dataset(tmp_path / "bad", [[1, 2], [1000]], vocab_size=1000)
    assert not list(tmp_path.glob("bad*")) and not list(tmp_path.glob(".bad*"))


def test_hh_rlhf_split_on_hand_made_transcripts():
    human, assistant = "\n\nHuman: ", "\n\nAssistant:"
    first = f"{human}Hi there{assistant} Hello! How can I help?{human}Tell me a joke"
    chosen = f"{first}{assistant} Sure, here is one: why did the chicken cross the road?"
    rejected = f"{first}{assistant} Sure, no."
    assert split_hh_pair(chosen, rejected) == (
        first + assistant,
        " Sure, here is one: why did the chicken cross the road?",
        " Sure, no.",
    )
    # The common prefix ends inside the marker ("\n\nAssistant" vs "\n\nAssistance"):
    # the split goes back to the previous complete marker.
    a = f"{human}Q{assistant} A{human}R{assistant} X"
    b = f"{human}Q{assistant} A{human}R\n\nAssistance"
    assert split_hh_pair(a, b) == (
        f"{human}Q{assistant}",
        f" A{human}R{assistant} X",
        f" A{human}R\n\nAssistance",
    )
    assert split_hh_pair(chosen, chosen)[0] == first + assistant  # identical pair: a tie
    with pytest.raises(BadRecord, match="not an HH-RLHF transcript"):
        split_hh_pair("Human: hi Assistant: yo", "Human: hi Assistant: no")
    with pytest.raises(BadRecord, match="share no prefix"):
        split_hh_pair(f"{human}A{assistant} x", f"{human}B{assistant} y")


def test_hh_rlhf_records_read_directly(tmp_path, tokenizer_dir, hf_tokenizer):
    rng = random.Random(5)
    records, expected = [], []
    for _ in range(40):
        prompt = "".join(
            f"\n\nHuman: {nonblank(rng)}\n\nAssistant: {nonblank(rng)}"
            for _ in range(rng.randint(0, 2))
        )
        prompt += f"\n\nHuman: {nonblank(rng)}\n\nAssistant:"
        chosen, rejected = " " + nonblank(rng), " " + nonblank(rng)
        if chosen.startswith(rejected) or rejected.startswith(chosen):
            continue
        records.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        expected.append((prompt, chosen, rejected))
    rc, prefix = run(tmp_path, records, "preference", tokenizer_dir)
    assert rc == 0
    tok, eos = hf_tokenizer, hf_tokenizer.eos_token_id
    assert read_stream(prefix + "_prompt") == [ids(tok, p) for p, _, _ in expected]
    assert read_stream(prefix + "_chosen") == [ids(tok, c) + [eos] for _, c, _ in expected]
    assert read_stream(prefix + "_rejected") == [ids(tok, r) + [eos] for _, _, r in expected]
    # The same file gives PPO prompts.
    rc, prompts = run(tmp_path, records, "prompt", tokenizer_dir, name="hh_prompts")
    assert rc == 0 and read_stream(prompts) == [ids(tok, p) for p, _, _ in expected]


def test_workers_output_is_byte_identical(tmp_path, tokenizer_dir):
    rng = random.Random(11)
    lines = []
    for i, record in enumerate(random_records("preference", 400, seed=4)):
        record["chosen_logprobs"] = [-rng.uniform(0, 50) for _ in range(2)]
        record["rejected_logprobs"] = [-rng.uniform(0, 50) for _ in range(2)]
        lines.append((json.dumps(record, ensure_ascii=False) + "\n").encode())
        if i % 37 == 5:
            lines.append(b"\n")
        if i % 53 == 7:
            lines.append(b'{"prompt": "x", "chosen": "", "rejected": "y"}\n')
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(lines))
    outputs = {}
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        argv = [
            "--input",
            str(src),
            "--kind",
            "preference",
            "--tokenizer",
            str(tokenizer_dir),
            "--output-prefix",
            str(out / "data"),
            "--no-progress",
            "--workers",
            str(workers),
            "--chunk-size",
            "7",
            "--skip-bad",
            "--max-length",
            "150",
        ]
        assert preprocess_main(argv) == 0
        outputs[workers] = {p.name: p.read_bytes() for p in out.iterdir()}
    sidecar = json.loads(outputs[1]["data.json"])
    assert sidecar["lines"]["skipped_bad"] > 5 and sidecar["lines"]["blank"] > 5
    assert 0 < sidecar["truncation"]["examples_truncated"] < 390
    assert len(outputs[1]) == 13  # 6 streams x (.bin, .idx) + sidecar
    assert outputs[2] == outputs[1] and outputs[3] == outputs[1]


GOOD = b'{"prompt": "hello there", "response": "general kenobi"}\n'
BAD_LINES = {
    "malformed JSON": b'{"prompt": "hello", "response": "x"\n',
    "missing key 'response'": b'{"prompt": "hello", "answer": "x"}\n',
    "empty response": b'{"prompt": "hello", "response": "  \\n "}\n',
    "invalid UTF-8": b'{"prompt": "caf\xe9", "response": "x"}\n',
    "must be a string": b'{"prompt": ["a"], "response": "x"}\n',
    "expected a JSON object": b'["prompt", "response"]\n',
}


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("reason", list(BAD_LINES))
def test_bad_input_stops_with_file_line_and_leaves_nothing(
    tmp_path, tokenizer_dir, capsys, reason, workers
):
    lines = [GOOD] * 600 + [b"\n", BAD_LINES[reason]] + [GOOD] * 5
    rc, prefix = run(
        tmp_path, lines, "sft", tokenizer_dir, "--workers", workers, "--chunk-size", "16"
    )
    assert rc == 2
    error = capsys.readouterr().err
    assert f"{tmp_path / 'out.jsonl'}:602: " in error and reason in error
    assert "--skip-bad" in error
    assert list((tmp_path / "out").iterdir()) == []  # not even temporary files


def test_failed_run_keeps_previous_output_and_rerun_replaces_it(tmp_path, tokenizer_dir):
    records = random_records("preference", 20, seed=8)
    rc, prefix = run(tmp_path, records, "preference", tokenizer_dir)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert rc == 0 and "out_task.bin" in before
    rc, _ = run(tmp_path, records, "preference", tokenizer_dir)  # no --overwrite: refused
    assert rc == 2
    rc, _ = run(tmp_path, [GOOD], "preference", tokenizer_dir, "--overwrite")  # lacks 'chosen'
    assert rc == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    for record in records:
        del record["task"]
    rc, _ = run(tmp_path, records, "preference", tokenizer_dir, "--overwrite")
    after = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert rc == 0 and "out_task.bin" not in after and len(after) == 7


def test_skip_bad_counts_and_lists_every_skipped_line(
    tmp_path, tokenizer_dir, hf_tokenizer, capsys
):
    rng = random.Random(3)
    lines, good, bad = [], [], {}
    for line_number in range(1, 301):
        if rng.random() < 0.2:
            reason = rng.choice(list(BAD_LINES))
            lines.append(BAD_LINES[reason])
            bad[line_number] = reason
        elif rng.random() < 0.03:
            lines.append(b"   \n")
            bad[line_number] = "blank line"
        else:
            record = random_records("sft", 1, seed=line_number)[0]
            lines.append((json.dumps(record) + "\n").encode())
            good.append(record)
    rc, prefix = run(tmp_path, lines, "sft", tokenizer_dir, "--skip-bad", "--workers", "2")
    assert rc == 0
    tok, eos = hf_tokenizer, hf_tokenizer.eos_token_id
    expected = [ids(tok, r["prompt"]) + ids(tok, r["response"]) + [eos] for r in good]
    assert read_stream(prefix) == expected
    sidecar = json.loads(Path(prefix + ".json").read_text())
    listed = {item["line"]: item["reason"] for item in sidecar["skipped"]["lines"]}
    assert set(listed) == set(bad)
    assert all(bad[line] in listed[line] for line in bad)
    num_bad = sum(reason != "blank line" for reason in bad.values())
    assert sidecar["lines"] == {
        "read": 300,
        "blank": len(bad) - num_bad,
        "skipped_bad": num_bad,
        "dropped": 0,
    }
    assert sum(sidecar["skipped"]["by_reason"].values()) == num_bad
    summary = capsys.readouterr().out
    assert f"skipped_bad={num_bad}" in summary and f"documents={len(good)}" in summary
    malformed = sum(reason == "malformed JSON" for reason in bad.values())
    assert sidecar["skipped"]["by_reason"]["malformed JSON"] == malformed
    assert f"malformed_JSON:{malformed}" in summary


def reference_fit(prompt: list[int], responses: list[list[int]], limit: int, keep: int):
    """The truncate policy for preference pairs, stated directly: the prompt keeps
    min(len, keep) tokens for sure, the longest response then gets all the room it can, the
    prompt takes what is left; a cut response ends with its EOS (its last token)."""
    longest = max(map(len, responses))
    if len(prompt) + longest <= limit:
        return prompt, responses
    response_room = min(longest, limit - min(len(prompt), keep))
    prompt_kept = min(len(prompt), limit - response_room)
    kept = prompt[len(prompt) - prompt_kept :]
    room = limit - prompt_kept
    return kept, [r if len(r) <= room else r[: room - 1] + r[-1:] for r in responses]


@pytest.mark.parametrize("policy", ["truncate", "drop", "error"])
def test_truncation_policies_match_reference(tmp_path, tokenizer_dir, hf_tokenizer, policy):
    tok, eos = hf_tokenizer, hf_tokenizer.eos_token_id
    records = random_records("preference", 120, seed=9)
    for record in records:
        del record["task"]
    limit, keep = 250, 80
    extra = ["--max-length", str(limit), "--max-prompt-length", str(keep), "--truncation", policy]
    rc, prefix = run(
        tmp_path,
        records,
        "preference",
        tokenizer_dir,
        *extra,
        *(["--skip-bad"] if policy == "error" else []),
    )
    assert rc == 0
    expected, too_long = [], 0
    for r in records:
        prompt = ids(tok, r["prompt"])
        responses = [ids(tok, r["chosen"]) + [eos], ids(tok, r["rejected"]) + [eos]]
        if len(prompt) + max(map(len, responses)) > limit:
            too_long += 1
            if policy != "truncate":
                continue
        expected.append(reference_fit(prompt, responses, limit, keep))
    assert 30 < too_long < 100
    assert read_stream(prefix + "_prompt") == [p for p, _ in expected]
    assert read_stream(prefix + "_chosen") == [rs[0] for _, rs in expected]
    assert read_stream(prefix + "_rejected") == [rs[1] for _, rs in expected]
    sidecar = json.loads(Path(prefix + ".json").read_text())
    truncation = sidecar["truncation"]
    assert truncation["examples_truncated"] == (too_long if policy == "truncate" else 0)
    assert truncation["dropped"] == (too_long if policy == "drop" else 0)
    assert sidecar["lines"]["skipped_bad"] == (too_long if policy == "error" else 0)


def test_preference_truncation_cuts_the_prompt_first_and_keeps_eos(
    tmp_path, tokenizer_dir, hf_tokenizer, capsys
):
    tok, eos = hf_tokenizer, hf_tokenizer.eos_token_id
    records = random_records("preference", 120, seed=21)
    for record in records:
        del record["task"]
    limit = 60
    rc, prefix = run(tmp_path, records, "preference", tokenizer_dir, "--max-length", str(limit))
    assert rc == 0
    expected = [
        reference_fit(
            ids(tok, r["prompt"]),
            [ids(tok, r["chosen"]) + [eos], ids(tok, r["rejected"]) + [eos]],
            limit,
            keep=1,  # the default for preference data: the prompt gives way first
        )
        for r in records
    ]
    prompts, chosen = read_stream(prefix + "_prompt"), read_stream(prefix + "_chosen")
    assert prompts == [p for p, _ in expected]
    assert chosen == [rs[0] for _, rs in expected]
    assert read_stream(prefix + "_rejected") == [rs[1] for _, rs in expected]
    assert all(response[-1] == eos for response in chosen)
    full_prompts = [ids(tok, r["prompt"]) for r in records]
    removed = sum(len(a) - len(b) for a, b in zip(full_prompts, prompts))
    truncation = json.loads(Path(prefix + ".json").read_text())["truncation"]
    assert removed > 0 and truncation["prompt_tokens_removed"] == removed
    assert truncation["max_prompt_length"] == 1
    summary = capsys.readouterr().out
    assert f"prompt_tokens_removed={removed}" in summary
    assert f"responses_cut={truncation['responses_cut']}" in summary


def test_prompt_truncation_keeps_the_end(tmp_path, tokenizer_dir, hf_tokenizer):
    records = random_records("prompt", 60, seed=12)
    rc, prefix = run(tmp_path, records, "prompt", tokenizer_dir, "--max-length", "9")
    assert rc == 0
    assert read_stream(prefix) == [ids(hf_tokenizer, r["prompt"])[-9:] for r in records]


def test_preference_logprobs_round_trip_and_validation(tmp_path, tokenizer_dir, capsys):
    rng = random.Random(2)
    records = random_records("preference", 30, seed=6)
    for record in records:
        record["chosen_logprobs"] = [-rng.uniform(0, 80) for _ in range(3)]
        record["rejected_logprobs"] = [-rng.uniform(0, 80) for _ in range(3)]
    rc, prefix = run(tmp_path, records, "preference", tokenizer_dir)
    assert rc == 0 and json.loads(Path(prefix + ".json").read_text())["num_behaviour_policies"] == 3
    for side in ("chosen", "rejected"):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        stream = IndexedDataset(f"{prefix}_{side}_logprobs")
        got = np.stack([stream[i] for i in range(len(stream))])
        want = np.array([r[f"{side}_logprobs"] for r in records], dtype=np.float32)
        assert got.dtype == np.float32 and np.array_equal(got, want)
    bad_cases = {
        "NaN/inf": [math.nan, -1.0, -2.0],
        "no log-probability": [0.5, -1.0, -2.0],
        "same K": [-1.0, -2.0],
    }
    for needle, values in bad_cases.items():
        broken = [dict(r) for r in records]
        broken[17]["chosen_logprobs"] = values
        if needle == "same K":
            broken[17]["rejected_logprobs"] = values
        rc, _ = run(tmp_path, broken, "preference", tokenizer_dir, name="broken")
        error = capsys.readouterr().err
        assert rc == 2 and ":18: " in error and needle in error, error


def test_parquet_and_datasets_directories_match_jsonl(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    records = random_records("sft", 80, seed=10)
    rc, reference = run(
        tmp_path, records, "sft", tokenizer_dir, "--json-keys", "prompt=prompt", name="ref"
    )
    renamed = [{"q": r["prompt"], "a": r["response"]} for r in records]
    dataset = datasets.Dataset.from_list(renamed)
    dataset.to_parquet(str(tmp_path / "data.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(3))}).save_to_disk(
        str(tmp_path / "saved_dict")
    )
    inputs = {
        "parquet": [str(tmp_path / "data.parquet")],
        "saved": [str(tmp_path / "saved")],
        "dict": [str(tmp_path / "saved_dict"), "--split", "train"],
    }
    for name, args in inputs.items():
        prefix = str(tmp_path / name)
        argv = [
            "--input",
            *args,
            "--kind",
            "sft",
            "--tokenizer",
            str(tokenizer_dir),
            "--output-prefix",
            prefix,
            "--json-keys",
            "prompt=q",
            "response=a",
            "--no-progress",
        ]
        assert preprocess_main(argv) == 0, name
        for suffix in ("", "_loss_mask"):
            for ext in (".bin", ".idx"):
                assert (
                    Path(prefix + suffix + ext).read_bytes()
                    == Path(reference + suffix + ext).read_bytes()
                ), name
    argv = [
        "--input",
        str(tmp_path / "saved_dict"),
        "--kind",
        "sft",
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        str(tmp_path / "x"),
        "--no-progress",
    ]
    assert preprocess_main(argv) == 2  # two splits and no --split


@pytest.mark.launch
def test_command_line(tmp_path, tokenizer_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"text": "Hello world."}, {"text": "Bye."}])
    cmd = [
        sys.executable,
        str(REPO / "tools" / "preprocess_data.py"),
        "--input",
        str(tmp_path / "p.jsonl"),
        "--kind",
        "prompt",
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        str(tmp_path / "p"),
        "--json-keys",
        "prompt=text",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[preprocess_data] done: kind=prompt documents=2" in done.stdout
    assert "preprocess" in done.stderr  # the progress bar


def test_prompt_special_tokens_for_a_tokenizer_that_adds_bos(tmp_path, tokenizer_dir):
    import shutil

    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    bos_dir = tmp_path / "bos_tokenizer"
    shutil.copytree(tokenizer_dir, bos_dir)
    backend = Tokenizer.from_file(str(bos_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    backend.save(str(bos_dir / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(str(bos_dir))
    records = random_records("sft", 20, seed=13)
    for flag, prompt_specials in (([], False), (["--prompt-special-tokens"], True)):
        rc, prefix = run(tmp_path, records, "sft", bos_dir, *flag, "--overwrite")
        assert rc == 0
        expected = [
            tok(r["prompt"], add_special_tokens=prompt_specials)["input_ids"]
            + ids(tok, r["response"])
            + [2]
            for r in records
        ]
        assert read_stream(prefix) == expected
        assert all((seq[0] == 1) == prompt_specials for seq in expected)
