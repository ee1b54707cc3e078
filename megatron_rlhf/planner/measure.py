"""The scaling study's measurements: one stage of one model in one layout, on this launch.

Stages (each runs our real code path):
  actor_train   ``TrainEngine.step`` of an LM-head model; loss from the response tokens' log-probs
                (``token_logprobs``: the fused kernel PPO's policy loss is built on)
  critic_train  ``TrainEngine.step`` of a scalar-head model; squared error of the values
  score         ``pipeline_forward`` + the response log-probs without autograd (reference pass)
  generate      ``generation.generate`` with the KV cache (greedy, no early stop)

Peak memory on the CPU comes from the torch profiler's allocator tracking
(``profile_memory=True``): every CPU allocation and free from the model's construction on,
with the allocator's running total; the peak of the measured step is the highest running total
inside its ``record_function`` window (so weights, gradients and Adam state built before the
step count, and nothing outside torch's allocator does). The profiler subtracts a free from that
total only on a thread it profiles, and gloo's worker thread often drops the last reference to a
collective's tensors (every TP all-reduce and all-gather, every PP send), so those bytes would
stay counted for the rest of the profile (0.1-47 MB on the TP=2 rows, growing with the number of
collectives); :func:`count_frees_on_every_thread` switches c10's allocator to count every
thread's frees. On a GPU:
``torch.cuda.max_memory_allocated`` over the step. The first step is a warm-up (Adam state is
allocated there); the timed step runs after, outside the profiler. Every rank measures its own
peak; a row reports the largest.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from megatron_rlhf.distributed.layouts import Layout
from megatron_rlhf.distributed.parallel import is_last_stage, model_groups, vocab_group
from megatron_rlhf.kernels import cpu_logprobs
from megatron_rlhf.planning import hardware, memory
from megatron_rlhf.planning.shapes import ModelShape, model_params

STAGES = ("actor_train", "critic_train", "score", "generate")
WINDOW = "scaling_study/measured_step"


@dataclass(kw_only=True)
class StudyWork:
    """The batch every stage runs (per data-parallel replica)."""

    micro_batch: int = 2
    """Sequences per micro-batch (and generated per replica)."""
    prompt_len: int = 32
    """Prompt tokens per sequence."""
    response_len: int = 32
    """Response tokens per sequence (generated, or scored/trained on)."""
    microbatches: int = 2
    """Micro-batches per training step (1F1B keeps min(pp, this) in flight)."""
    packed: bool = False
    """Training and scoring micro-batches are one packed row of the ``micro_batch`` sequences
    (each attended alone, data/packing.py) instead of ``micro_batch`` rows."""

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


def planned_bytes(shape: ModelShape, tp: int, pp: int, dp: int, stage: str, work: StudyWork):
    """The planner's peak bytes per rank for a study row (fp32 on the CPU, bf16 on GPUs)."""
    e = 4 if not torch.cuda.is_available() else 2
    layout = Layout(tp=tp, pp=pp, dp=dp)
    rows, width, response, sequence = work.micro_batch, work.seq_len, work.response_len, None
    if work.packed and stage != "generate":
        rows, width, response = 1, work.micro_batch * width, work.micro_batch * response
        sequence = work.seq_len
    load = memory.Workload(
        micro_batch=rows,
        seq_len=width,
        response_len=response,
        num_microbatches=work.microbatches,
        element_bytes=e,
        distributed_optimizer=torch.cuda.is_available(),
        # what the study's models run (attention_backend auto): the fused Triton kernel keeps
        # O(s); PyTorch, and TE, which never fuses BLOOM's ALiBi, store (B, H, S, S)
        fused_attention=memory.fused_attention(_attention_backend()),
        packed_sequence_len=sequence,
        logprob_scratch=not torch.cuda.is_available() and not cpu_logprobs.enabled(),
    )
    if stage == "actor_train":
        return memory.train_memory(shape, layout, "lm", load).total
    if stage == "critic_train":
        return memory.train_memory(shape, layout, "scalar", load).total
    if stage == "score":
        return memory.forward_memory(shape, layout, "lm", load).total
    return memory.generate_memory(
        shape, layout, work.micro_batch, work.prompt_len, work.response_len, e, load.fused_attention
    ).total


def _attention_backend() -> str:
    """The backend ``BloomModel``'s default (``auto``) resolves to on this machine."""
    from megatron_rlhf.distributed.parallel import compute_device
    from megatron_rlhf.models.bloom.spec import resolve_attention_backend

    return resolve_attention_backend("auto", compute_device())


def run_row(shape: ModelShape, stage: str, work: StudyWork, seed: int = 0) -> dict:
    """Build the model, warm up, measure peak memory of one step, then time one step."""
    torch.manual_seed(seed)
    cuda = torch.cuda.is_available()
    gc.collect()  # the previous row's model must not be freed inside this row's profile
    with _memory_tracker() as tracker:
        model, runner = _build(shape, stage, work)
        runner()  # warm-up: allocates Adam state, the KV cache's first use, kernel workspaces
        with tracker.window():
            runner()
    seconds = _timed(runner, cuda)
    groups = model_groups(model)
    tp, pp, dp = groups.tp.size(), groups.pp.size(), groups.dp.size()
    tokens = dp * work.micro_batch * _tokens_per_row(stage, work)
    planned = planned_bytes(shape, tp, pp, dp, stage, work)
    row = {
        "model": shape.name,
        "params": model_params(shape),
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "stage": stage,
        "tokens_per_s": tokens / seconds,
        "step_s": seconds,
        "peak_mem_measured_mb": tracker.peak_bytes / 2**20,
        "peak_mem_planned_mb": planned / 2**20,
        "mfu": "",
    }
    gpu = hardware.cuda_gpu()
    if gpu is not None:
        row["mfu"] = hardware.mfu(_stage_flops(shape, stage, work) * dp, seconds, tp * pp * dp, gpu)
    return row


def _tokens_per_row(stage: str, work: StudyWork) -> int:
    if stage == "generate":
        return work.seq_len  # end to end: prompt + generated tokens
    if stage == "score":
        return work.seq_len
    return work.seq_len * work.microbatches


def _stage_flops(shape: ModelShape, stage: str, work: StudyWork) -> float:
    """Model FLOPs of one replica's step (MFU numerator)."""
    n, l_, h = model_params(shape), shape.num_layers, shape.hidden_size
    tokens = work.micro_batch * _tokens_per_row(stage, work)
    if stage.endswith("_train"):
        return hardware.train_flops_per_token(n, l_, h, work.seq_len) * tokens
    return hardware.forward_flops_per_token(n, l_, h, work.seq_len) * tokens


def _timed(runner, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    runner()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _build(shape: ModelShape, stage: str, work: StudyWork):
    """A fresh model and a no-argument callable running one step of ``stage`` on it."""
    from megatron_rlhf.models.bloom.config import BloomArchitecture
    from megatron_rlhf.models.bloom.model import BloomModel

    arch = BloomArchitecture(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        max_sequence_length=work.seq_len,
    )
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    head = "scalar" if stage == "critic_train" else "lm"
    model = BloomModel(arch, head=head, params_dtype=dtype)  # on the compute device
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, shape.vocab_size, (work.micro_batch, work.seq_len), generator=generator)
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)
    if stage == "generate":
        prompt_ids, prompt_mask = ids[:, : work.prompt_len], mask[:, : work.prompt_len]
        return model, _generate_step(model, prompt_ids, prompt_mask, work)
    if work.packed:  # the rows back to back in one, each sequence its own id
        ids, mask = (
            ids.reshape(1, -1),
            (torch.arange(ids.numel(), device=ids.device) // work.seq_len + 1)[None],
        )
    if stage == "score":
        return model, _score_step(model, ids, mask, work)
    return model, _train_step(model, stage, ids, mask, work)


def _response_logprobs(model, logits_shard, ids, work: StudyWork) -> torch.Tensor:
    """log pi of the response tokens (B, N) from this rank's vocabulary shard of the logits,
    through the fused kernel PPO's scoring and policy loss are built on."""
    from megatron_rlhf.kernels import token_logprobs

    if work.packed:  # each sequence's response positions of the one packed row
        starts = torch.arange(work.micro_batch, device=ids.device)[:, None] * work.seq_len
        positions = (
            starts + torch.arange(work.prompt_len - 1, work.seq_len - 1, device=ids.device)
        ).reshape(-1)
        predicting, targets = logits_shard[:, positions], ids[:, positions + 1]  # (1, B*N, ...)
    else:
        predicting = logits_shard[:, work.prompt_len - 1 : work.seq_len - 1]  # (B, N, V/tp)
        targets = ids[:, work.prompt_len : work.seq_len]  # (B, N)
    return token_logprobs(predicting, targets, 1.0, vocab_group(model_groups(model)))


def _train_step(model, stage, ids, mask, work: StudyWork):
    from megatron_rlhf.training import TrainEngine
    from megatron_rlhf.training.config import OptimConfig

    engine = TrainEngine(model, OptimConfig(lr=1e-7, warmup_fraction=0.0), total_steps=100)
    p, n = work.prompt_len, work.response_len

    def loss_fn(output, microbatch):
        if stage == "actor_train":
            logprobs = _response_logprobs(model, output, microbatch["input_ids"], work)
            return -logprobs.mean(), {}
        values = output[:, p - 1 : p - 1 + n, 0]
        return (values - 1.0).pow(2).mean(), {}

    batch = [{"input_ids": ids, "padding_mask": mask} for _ in range(work.microbatches)]
    return lambda: engine.step(batch, loss_fn)


def _score_step(model, ids, mask, work: StudyWork):
    from megatron_rlhf.distributed.pipeline import pipeline_forward

    model.eval()
    last_stage = is_last_stage(model_groups(model))

    @torch.no_grad()
    def step():
        output = pipeline_forward(model, ids, mask)
        if last_stage:
            _response_logprobs(model, output, ids, work)

    return step


def _generate_step(model, prompt_ids, prompt_mask, work: StudyWork):
    from megatron_rlhf.generation import SamplingConfig
    from megatron_rlhf.generation.decode_loop import generate

    sampling = SamplingConfig(max_new_tokens=work.response_len, greedy=True, eos_id=-1, pad_id=3)
    return lambda: generate(model, prompt_ids, prompt_mask, sampling)


class _memory_tracker:
    """Peak allocated bytes of a window: CUDA's counters, or the profiler's CPU allocator log."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.peak_bytes = 0

    def __enter__(self):
        if self.cuda:
            return self
        from torch.profiler import ProfilerActivity, profile

        count_frees_on_every_thread()
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def window(self):
        if self.cuda:
            return _CudaWindow(self)
        return torch.profiler.record_function(WINDOW)

    def __exit__(self, *exc):
        if self.cuda or exc[0] is not None:
            if not self.cuda:
                self.profiler.__exit__(*exc)
            return False
        self.profiler.__exit__(None, None, None)
        self.peak_bytes = cpu_window_peak(self.profiler)
        return False


class _CudaWindow:
    def __init__(self, tracker):
        self.tracker = tracker

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.tracker.peak_bytes = torch.cuda.max_memory_allocated()
        return False


def count_frees_on_every_thread() -> None:
    """Set c10's ``caffe2_report_cpu_memory_usage`` flag: the CPU allocator then keeps its running
    total on every thread (without it, only on profiled ones, so a tensor freed by gloo's worker
    thread is never subtracted). The flag has no Python binding; it is a global in libc10, left
    on for the rest of the process (a mutex and a size-table entry per CPU allocation)."""
    import ctypes
    import os

    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(library), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"{library}: no FLAGS_caffe2_report_cpu_memory_usage ({err}); without it the CPU "
            "peak counts tensors that gloo's threads freed"
        ) from err
    flag.value = True


def cpu_window_peak(profiler) -> int:
    """Highest allocator total inside the ``WINDOW`` annotation (bytes live since the profiler
    started, so everything built inside the profile counts)."""
    from torch._C._profiler import _EventType

    nodes, allocations, window = (
        list(profiler.profiler.kineto_results.experimental_event_tree()),
        [],
        None,
    )
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            fields = node.extra_fields
            allocations.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
        elif node.name == WINDOW:
            window = (node.start_time_ns, node.end_time_ns)
    if window is None:
        raise RuntimeError("the profiler recorded no measured-step window")
    allocations.sort()
    # The allocator's total runs on across profiler sessions: count from this session's start.
    start = allocations[0][1] - allocations[0][2]
    before = [total - start for t, total, _ in allocations if t < window[0]]
    inside = [total - start for t, total, _ in allocations if window[0] <= t <= window[1]]
    return max(inside + before[-1:])


SHAPES = {
    "tiny": ModelShape(name="tiny", num_layers=2, hidden_size=64, num_heads=4, vocab_size=1024),
    "small": ModelShape(name="small", num_layers=4, hidden_size=256, num_heads=8, vocab_size=8192),
    "medium": ModelShape(
        name="medium", num_layers=8, hidden_size=512, num_heads=8, vocab_size=16384
    ),
    "560m-shaped": ModelShape(
        name="560m-shaped", num_layers=24, hidden_size=1024, num_heads=16, vocab_size=16384
    ),
}
"""CPU study sizes: BLOOM-560m's depth, width and heads with a 16k vocabulary at the top."""


def study_shape(name: str) -> ModelShape:
    """A CPU study size or a BLOOM preset / config.json (``shapes.model_shape``)."""
    from megatron_rlhf.planning.shapes import model_shape

    return SHAPES[name] if name in SHAPES else model_shape(name)


def worker_main(argv: list[str]) -> int:
    """One launch: every requested row, grouped by layout; rank 0 writes the rows as JSON."""
    import argparse
    import json

    import torch.distributed as dist

    from megatron_rlhf.distributed import destroy, initialize
    from megatron_rlhf.utils import is_rank0, write_json

    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf.planner.measure")
    parser.add_argument("--rows", required=True, help="JSON list of [size, tp, pp, stage]")
    parser.add_argument("--work", required=True, help="JSON of StudyWork fields")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes the rows to")
    args = parser.parse_args(argv)
    work = StudyWork(**json.loads(args.work))
    rows, done = json.loads(args.rows), []
    for size, tp, pp, stage in sorted(rows, key=lambda r: (r[1], r[2])):
        shape = study_shape(size)
        initialize(tp, pp, arch=shape)
        row = run_row(shape, stage, work)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row["peak_mem_measured_mb"])
        row["peak_mem_measured_mb"] = max(gathered)
        done.append(row)
        if is_rank0():
            print(json.dumps(row), flush=True)
            write_json(args.out, done)
    destroy()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(worker_main(sys.argv[1:]))
