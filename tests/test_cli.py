"""The command line as a newcomer meets it: ``--help`` of every command parses before torch or
megatron-core load, ``--print-config`` lists every key with its default and doc, ``--version``
says once what Megatron-Core's import warnings said on every command, and a script may call a
command's ``main()`` without an ``if __name__ == "__main__":`` guard."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import typing

import pytest
from torchrun_util import REPO

from megatron_rlhf.cli import COMMANDS, main
from megatron_rlhf.config import describe_config

TOOLS = {
    "tools/preprocess_data.py": "megatron_rlhf.data.preprocess",
    "tools/build_rehearsal_clusters.py": "megatron_rlhf.rehearsal.cli",
    "tools/convert_checkpoint.py": "megatron_rlhf.checkpoint.convert",
}
HEAVY = ("torch", "megatron.core", "transformers", "sentence_transformers", "faiss")


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.launch
def test_every_help_parses_before_any_heavy_import():
    """One fresh interpreter asks every command and tool for --help; none may load torch."""
    modules = [module for module, _ in COMMANDS.values()] + list(TOOLS.values())
    code = textwrap.dedent(f"""
        import importlib, json, sys
        from megatron_rlhf.cli import main
        loaded = {{}}
        for name in {list(COMMANDS)!r}:
            try:
                main([name, "--help"])
            except SystemExit:
                pass
        for module in {list(TOOLS.values())!r}:
            try:
                importlib.import_module(module).main(["--help"])
            except SystemExit:
                pass
        print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))
    """)
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], modules
    assert proc.stdout.count("usage:") == len(COMMANDS) + len(TOOLS)


def _leaf_keys(cls, prefix: str = "") -> list[str]:
    from megatron_rlhf.config import key_of

    keys = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = key_of(field)  # async_ is the key async
        if dataclasses.is_dataclass(hints[field.name]):
            keys += _leaf_keys(hints[field.name], f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


@pytest.mark.parametrize(
    "command, config_class",
    [
        ("train-ppo", "megatron_rlhf.ppo.config:TrainPPOConfig"),
        ("train-reward", "megatron_rlhf.reward.train:RewardTrainConfig"),
        ("train-sft", "megatron_rlhf.training.sft:SFTConfig"),
    ],
)
def test_print_config_lists_every_key_with_default_and_doc(command, config_class, capsys):
    import importlib

    module, name = config_class.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert main([command, "--print-config"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" = ")[0] for line in lines] == _leaf_keys(cls)
    for line in lines:
        key, rest = line.split(" = ", 1)
        default, comment = rest.split("  # ", 1)
        type_name, doc = comment.split(": ", 1)
        assert len(doc) > 10, f"{key}: no docstring under the field"
    # defaults as a run would get them, factories included (actor_optim.lr is the PPO actor's)
    by_key = dict(line.split("  # ")[0].split(" = ") for line in lines)
    if command == "train-ppo":
        assert by_key["actor_optim.lr"] == "5e-07" and by_key["critic_optim.lr"] == "5e-06"
        assert by_key["models.actor"] == "REQUIRED" and by_key["ppo.kl.estimator"] == '"k1"'
    if command == "train-reward":
        assert by_key["loss"] == '"am"' and by_key["train.output_dir"] == "REQUIRED"


@dataclasses.dataclass(kw_only=True)
class Inner:
    depth: int = 3
    """How deep
    it goes."""


@dataclasses.dataclass(kw_only=True)
class Outer:
    inner: Inner = dataclasses.field(default_factory=lambda: Inner(depth=7))
    name: str | None = None
    """A name."""


def test_describe_config_reads_multi_line_field_docstrings():
    assert describe_config(Outer).splitlines() == [
        "inner.depth = 7  # int: How deep it goes.",
        "name = null  # str | None: A name.",
    ]


def test_version_states_the_missing_backends_once(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert "megatron-core 0.16.1" in out
    for backend in ("Transformer Engine", "Apex"):
        assert backend in out


@pytest.mark.launch
def test_main_from_a_script_without_main_guard_saves_once(tmp_path):
    """dist_checkpointing's writer used a spawn Manager, which re-ran such a script at the first
    save; Megatron-Core's fallback warnings are silenced too."""
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    arch = tiny_architecture(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4)
    save_random_hf_bloom(tmp_path / "hf", arch)
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from megatron_rlhf.checkpoint.convert import main\n"
        f"rc = main(['hf-to-megatron', '--load', {str(tmp_path / 'hf')!r}, '--save', "
        f"{str(tmp_path / 'mc')!r}])\n"
        "print('script finished with', rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "default", str(script)], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("script finished with 0") == 1, proc.stdout
    assert proc.stdout.count("[hf-to-megatron] done:") == 1, proc.stdout
    assert (tmp_path / "mc" / "megatron_rlhf.json").is_file()
    assert "not installed" not in proc.stderr, proc.stderr
