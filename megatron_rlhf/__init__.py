"""megatron-rlhf: the recipe of "Stabilizing RLHF through Advantage Model and Selective
Rehearsal" (arXiv 2309.10202) for BLOOM models on Megatron-Core.

Folders follow the pipeline (see README.md):
  runtime/       the run and output locks, process helpers (below every other package)
  distributed/   torch.distributed + Megatron-Core parallel state, the CPU compatibility layer
  models/bloom/  one BLOOM trunk on Megatron-Core (ModuleSpec) with an LM or scalar head per role
  checkpoint/    Hugging Face <-> Megatron conversion and distributed checkpoints
  generation/    the batched, KV-cached rollout engine
  data/          indexed datasets (tools/preprocess_data.py), loaders, collators, tokenizer
  reward/        Reward Model and Advantage Model: losses, training, scoring, calibration
  rehearsal/     Selective Rehearsal curation: embeddings, FAISS k-means, top-k selection
  ppo/           rollout -> score -> advantages -> update, with the rehearsal NLL term
  kernels        (top-level kernels/fused/) fused log-probs over vocab shards, KL, GAE, attention
"""

import warnings

__version__ = "0.1.0"

# Megatron-Core warns at import, on every machine without Transformer Engine or Apex, that it
# falls back to its local PyTorch implementations: the intended path on CPU. Said once instead,
# by ``python -m megatron_rlhf --version`` and in the README.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")


def _kernels_from_the_source_tree() -> None:
    """``megatron_rlhf.kernels`` is the folder ``kernels/fused/`` (setup.py maps it). ``kernels/``
    itself holds no ``__init__.py`` on purpose: a regular package named ``kernels`` at the repo root
    would hide Hugging Face's ``kernels`` (which transformers imports) from every process started
    there, while a plain folder never wins over an installed package. A source tree that was never
    installed (a copy of the tree on a GPU machine with PYTHONPATH pointing at
    it) has no such mapping: there the folder beside this package is found by this finder, placed
    right after Python's path finder, so an installed copy is found first and an editable install
    resolves to the tree this package was imported from."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    kernels = Path(__file__).resolve().parents[1] / "kernels" / "fused"
    if (Path(__file__).parent / "kernels").is_dir() or not (kernels / "__init__.py").is_file():
        return  # an installed copy, or no tree around it

    class SourceTreeKernels(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != f"{__name__}.kernels":
                return None
            return importlib.util.spec_from_file_location(
                name, kernels / "__init__.py", submodule_search_locations=[str(kernels)]
            )

    finders = sys.meta_path
    after = next(
        (i + 1 for i, f in enumerate(finders) if f is importlib.machinery.PathFinder), len(finders)
    )
    if not any(type(f).__name__ == "SourceTreeKernels" for f in finders):
        finders.insert(after, SourceTreeKernels())


MEGATRON_JIT_ENV = "MEGATRON_RLHF_MEGATRON_JIT"


def _megatron_helpers_uncompiled() -> bool:
    """Megatron-Core wraps 38 small helpers (bias-GeLU, SwiGLU, fused cross entropy, MoE
    routing, ...; megatron-core 0.16.1) in ``torch.compile`` while it is imported
    (``megatron.core.jit.jit_fuser``). The wrapping alone imports TorchDynamo and Inductor:
    1.3-2.8 s of wall time and ~2 s of CPU in every process that imports Megatron-Core (each
    rank of each launch), measured on the benchmarks' 2-core VM. Our BLOOM calls none of those
    helpers (``tests/test_packaging.py`` records every call with Megatron's default kept):
    ``models/bloom/config.py`` turns Megatron's bias fusions off on every device, and the GeLU,
    layer norm and log-probs are our own or torch's.

    So, if Megatron-Core is not imported yet, this finder runs Megatron-Core's own switch,
    ``megatron.core.jit.disable_jit_fuser()``, as that module loads: the helpers stay plain
    Python functions, exactly as written. ``MEGATRON_RLHF_MEGATRON_JIT=compile`` keeps
    Megatron-Core's default (for a process that also runs Megatron-Core models of its own).
    Returns whether the finder was installed."""
    import importlib.abc
    import importlib.machinery
    import os
    import sys

    if os.environ.get(MEGATRON_JIT_ENV) == "compile" or "megatron.core.jit" in sys.modules:
        return False

    class MegatronJitOff(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "megatron.core.jit":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader

            class Loader(importlib.abc.Loader):
                def create_module(self, spec):
                    return loader.create_module(spec)

                def exec_module(self, module):
                    loader.exec_module(module)
                    disable = getattr(module, "disable_jit_fuser", None)
                    if disable is not None:
                        disable()

            spec.loader = Loader()
            return spec

    if not any(type(f).__name__ == "MegatronJitOff" for f in sys.meta_path):
        sys.meta_path.insert(0, MegatronJitOff())
    return True


_kernels_from_the_source_tree()
_megatron_helpers_uncompiled()
