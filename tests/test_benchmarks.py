"""The benchmark scripts stay runnable as the package changes under them.

Benchmarks are measured by hand, not in CI, so a renamed API breaks them silently (a merge once
left ``bench_refill.py`` importing a class that no longer existed). Every script under
``benchmarks/`` must import, and every ``from megatron_rlhf... import name`` in it, at module
level or inside a function, must name something that exists.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def our_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from megatron_rlhf... import name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_rlhf"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_imports_and_names_what_exists(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other by name
    name = f"_benchmark_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name}: no main()"
    missing = []
    for line, module_name, attribute in our_imports(path):
        imported = importlib.import_module(module_name)
        if not hasattr(imported, attribute):
            try:  # a submodule: from megatron_rlhf.generation import refill
                importlib.import_module(f"{module_name}.{attribute}")
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: {module_name} has no {attribute}")
    assert not missing, missing


def test_roofline_counts_the_flop_a_bloom_forward_does(monkeypatch):
    """``benchmarks/roofline.py``'s count of a forward (trunk over every token, LM head on every
    position) equals what torch's FLOP counter sees Hugging Face's BLOOM do, at an awkward
    shape; its backward is counted as twice the forward."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BloomConfig, BloomForCausalLM

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import roofline

    arch = dict(vocab_size=301, hidden_size=48, num_layers=3, num_heads=4)
    batch, seq = 3, 11
    hf = BloomForCausalLM(BloomConfig(vocab_size=301, hidden_size=48, n_layer=3, n_head=4)).eval()
    ids = torch.randint(0, 301, (batch, seq))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(ids)
    phase = roofline.Phase("forward")
    roofline.trunk(phase, arch, batch * seq, seq, 1)
    phase.matmul(batch * seq, arch["hidden_size"], arch["vocab_size"])
    assert phase.flop == counter.get_total_flops()
    backward = roofline.Phase("backward")
    roofline.trunk(backward, arch, batch * seq, seq, 1, backward=True)
    trunk_only = roofline.Phase("trunk")
    roofline.trunk(trunk_only, arch, batch * seq, seq, 1)
    assert backward.flop == 3 * trunk_only.flop


def test_roofline_params_are_the_models(monkeypatch):
    """The optimizer's sweep is sized by ``model_params``: HF BLOOM's parameter count (the LM
    head tied to the embedding; a scalar head adds a ``hidden -> 1`` score)."""
    from transformers import BloomConfig, BloomForCausalLM, BloomForSequenceClassification

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import roofline

    config = BloomConfig(vocab_size=301, hidden_size=48, n_layer=3, n_head=4, num_labels=1)
    arch = dict(vocab_size=301, hidden_size=48, num_layers=3, num_heads=4)
    lm = sum(p.numel() for p in BloomForCausalLM(config).parameters())
    scalar = sum(p.numel() for p in BloomForSequenceClassification(config).parameters())
    assert roofline.model_params(arch, lm=True) == lm
    assert roofline.model_params(arch, lm=False) == scalar


def test_critic_benchmark_errors_and_paired_interval_match_float64(monkeypatch):
    """``bench_async_critic.py``'s error of a critic against Monte-Carlo values (RMSE, mean
    signed error) and its paired 95 % interval equal numpy's and scipy's in float64."""
    import numpy as np
    from scipy import stats

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_async_critic as bench

    g = np.random.default_rng(3)
    values, truth = g.normal(size=37), g.normal(size=37)
    rmse, signed = bench.errors_of(torch.tensor(values, dtype=torch.float32), torch.tensor(truth))
    diff = values.astype(np.float32).astype(np.float64) - truth
    assert rmse == pytest.approx(np.sqrt(np.mean(diff**2)), rel=1e-12)
    assert signed == pytest.approx(np.mean(diff), rel=1e-12)
    arm, baseline = g.normal(size=15).tolist(), g.normal(size=15).tolist()
    d = np.subtract(arm, baseline)
    half = stats.t.ppf(0.975, 14) * d.std(ddof=1) / np.sqrt(15)
    mean, low, high = bench.paired_interval(arm, baseline)
    assert (mean, low, high) == pytest.approx((d.mean(), d.mean() - half, d.mean() + half))
    units = [{"seed": i % 5, "rmse": a} for i, a in enumerate(arm)]
    lower = [{"seed": i % 5, "rmse": a + 1.0 + 0.01 * i} for i, a in enumerate(arm)]
    assert bench.beats(units, lower) and not bench.beats(lower, units)


def test_roofline_takes_every_phase_of_the_planners_step_time(monkeypatch):
    """``roofline.planner_phases`` sums the planner's step-time model into the roofline's
    phases: every second of the planner's step lands in one phase, on one device with the
    machine's figures (a faster device: less time), and a planner phase it cannot place is an
    error, not a dropped term."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import roofline

    from megatron_rlhf.planning import plan

    arch = dict(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4)
    shape = (8, 16, 32, 4)

    def machine(tflops, gb_per_s):
        return SimpleNamespace(threads=2, peak=lambda dtype: tflops * 1e12,
                               read_bandwidth=gb_per_s * 1e9)  # fmt: skip

    slow = roofline.planner_phases(machine(1.0, 20.0), arch, shape)
    fast = roofline.planner_phases(machine(2.0, 40.0), arch, shape)
    assert set(slow) == {"rollout", "scoring", "update"}
    assert all(fast[k] == pytest.approx(slow[k] / 2) for k in slow)  # every term scales
    made = plan.make_plans
    best = {}

    def spy(request, top=10):
        best["plan"] = made(request, top)
        return best["plan"]

    monkeypatch.setattr(plan, "make_plans", spy)
    assert sum(roofline.planner_phases(machine(1.0, 20.0), arch, shape).values()) == (
        pytest.approx(best["plan"].plans[0].step_seconds)
    )
    best["plan"].plans[0].seconds["reshard"] = 1.0
    monkeypatch.setattr(plan, "make_plans", lambda request, top=10: best["plan"])
    with pytest.raises(ValueError, match="reshard"):
        roofline.planner_phases(machine(1.0, 20.0), arch, shape)
