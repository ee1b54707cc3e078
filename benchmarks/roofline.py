"""The PPO step's roofline (issue 49): the work each phase must do, this machine's rate at that
work's shapes, the floor that gives and the fraction of it a measured step reaches.

    python benchmarks/roofline.py --size 560m [--dtype fp32 bf16] [--threads 2]

prints the machine's rates and each phase's floor; ``bench_ppo_real_shapes.py --roofline``
prints the same floors beside the measured phase times.

**What is counted.** A phase is a list of matrix products and of memory sweeps. BLOOM's trunk
per token and layer: the four linears (QKV 3h^2, dense h^2, MLP 8h^2 multiply-adds, so 24 h^2
FLOP) plus attention (QK^T and AV over the context, 4 h c FLOP); the LM head 2 h V per position
that a sample or a loss reads (the models project only those: ``output_positions``), the
scalar heads nothing worth counting. A backward is twice its forward. With the step's shape
(B prompts of P tokens, N sampled tokens, micro-batches of m rows, S = P + N):

- rollout (our engine): one prefill of B x P tokens (LM head on B rows), then N - 1 decode steps
  of B rows, each reading every weight once (the vocabulary matrix is most of it);
- scoring: the reference's log-probs (trunk on every token, LM head on the N response
  positions), the critic's values and the reward model's score (trunk only), in micro-batches
  of m rows; the actor's log pi_old too when it is recomputed (``--recompute-old``);
- update: actor and critic forward + backward over the same micro-batches (3x the forward);
- optimizer: Adam over both trained models' parameters. A sweep, not a product: per parameter
  it reads weight, gradient and both moments and writes weight and moments (28 B in fp32),
  plus the gradient norm's read (4 B): 32 B a parameter (the gradient buffer's zeroing happens
  before the step's forward, outside this phase).

**The rates.** Each product is timed here, at its own (rows x k) @ (k x n) shape and dtype, on
``--threads`` threads (best of a few, after a warm-up, in the best of three ways: MKL's
``x @ W^T`` and ``W @ x^T``, and in fp32 oneDNN's, ``models/cpu_linear.py``, and for a few rows
our kernel's, ``kernels/fused/cpu_gemv.c``); the peak is the
best rate at any shape (a 4096^3 product or the phase's own). Sweeps run at this machine's streaming bandwidth: the best of a 1 GiB ``copy_``, a
1 GiB triad ``c = a + b`` and torch's fused Adam over 64M parameters, all bytes read and written
over the time. A phase's floor is the sum of
its products' FLOP over their measured rates plus its sweeps' bytes over the bandwidth: what
the same products would take back to back at the speed this machine does them, with nothing
else (no attention softmax, layer norms, GeLU, sampling, Python, communication). A decode
step's products are memory-bound at B rows, so their measured rate already holds the weight
reads; the bytes they must read are printed beside it (``weight bytes / bandwidth``).

The floor is a lower bound for *these* products: a faster algorithm (a smaller vocabulary
projection, speculative decoding) would lower it, and a phase can beat it only by not doing
some of this work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_ppo_real_shapes import SIZES, StepShape  # the benchmark's shapes (stdlib-only import)
from megatron_rlhf.kernels import cpu_gemv

from megatron_rlhf.models import cpu_linear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZER_BYTES_PER_PARAM = 32


@dataclass
class Phase:
    """A phase's products ``(rows, k, n, count, backward)`` and its swept bytes."""

    name: str
    products: list[tuple[int, int, int, int, bool]] = field(default_factory=list)
    sweep_bytes: float = 0.0

    def matmul(self, rows: int, k: int, n: int, count: int = 1, backward: bool = False):
        if rows > 0 and count > 0:
            self.products.append((rows, k, n, count, backward))

    @property
    def flop(self) -> float:
        return sum(2 * r * k * n * c * (3 if b else 1) for r, k, n, c, b in self.products)


def trunk(phase: Phase, arch: dict, rows: int, context: int, count: int, backward=False):
    """Every layer's linears and attention for ``count`` forwards of ``rows`` tokens each,
    attending over ``context`` positions on average."""
    h, layers = arch["hidden_size"], arch["num_layers"]
    for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
        phase.matmul(rows, k, n, count * layers, backward)
    # QK^T and AV: rows x h x context each (per head these are batched; counted as one product)
    phase.matmul(rows, h, context, 2 * count * layers, backward)


def model_params(arch: dict, lm: bool) -> int:
    h, v, layers = arch["hidden_size"], arch["vocab_size"], arch["num_layers"]
    per_layer = 12 * h * h + 13 * h  # weights + biases + 2 layer norms
    return v * h + 2 * h + layers * per_layer + 2 * h + (0 if lm else h)


def step_phases(
    arch: dict,
    prompts: int,
    prompt_tokens: int,
    new_tokens: int,
    micro_batch: int,
    recompute_old: bool = False,
) -> list[Phase]:
    """The four phases of one PPO step at this shape (actor, reference, critic, reward: BLOOMs
    of ``arch``, the critic and reward with scalar heads)."""
    h, v = arch["hidden_size"], arch["vocab_size"]
    b, p, n, m = prompts, prompt_tokens, new_tokens, micro_batch
    s = p + n
    rollout = Phase("rollout")
    trunk(rollout, arch, b * p, p, 1)  # prefill
    rollout.matmul(b, h, v)  # its last position's LM head
    for step in range(1, n):  # decode: B rows, context p + step
        trunk(rollout, arch, b, p + step, 1)
        rollout.matmul(b, h, v)

    micro = -(-b // m)
    scoring = Phase("scoring")
    lm_roles = 2 if recompute_old else 1  # the reference (and the actor)
    trunk(scoring, arch, m * s, s // 2, micro * (lm_roles + 2))  # + critic, reward
    scoring.matmul(m * n, h, v, micro * lm_roles)

    update = Phase("update")
    trunk(update, arch, m * s, s // 2, micro * 2, backward=True)  # actor, critic
    update.matmul(m * n, h, v, micro, backward=True)

    optimizer = Phase("optimizer")
    trained = model_params(arch, lm=True) + model_params(arch, lm=False)
    optimizer.sweep_bytes = trained * OPTIMIZER_BYTES_PER_PARAM
    return [rollout, scoring, update, optimizer]


class Machine:
    """This machine's limits, measured once: the peak matmul rate per dtype (a 4096^3 product,
    the best shape for MKL/oneDNN), the rate at any product's own shape, and the bandwidths
    (reading 1 GiB; copying 1 GiB, read + write bytes)."""

    def __init__(self, threads: int):
        torch.set_num_threads(threads)
        self.threads = threads
        self._rates: dict = {}
        self._read: float | None = None
        self._copy: float | None = None

    def rate(self, rows: int, k: int, n: int, dtype: torch.dtype) -> float:
        """FLOP/s of ``(rows x k) @ (k x n)`` in ``dtype`` (rows rounded up to a power of two
        from 64, so nearby shapes share a measurement)."""
        rows_key = rows if rows < 64 else 1 << (rows - 1).bit_length()
        key = (rows_key, k, n, dtype)
        if key not in self._rates:
            a = torch.randn(rows_key, k).to(dtype)
            w = torch.randn(n, k).to(dtype)  # F.linear's layout, as the models hold weights
            flop = 2 * rows_key * k * n
            reps = max(3, min(50, int(2e9 / flop)))
            layouts = (
                lambda: torch.nn.functional.linear(a, w),  # MKL
                lambda: w @ a.t(),  # MKL, the weight streamed row by row
                # fp32: oneDNN, or our kernel for a few rows (what our models run)
                lambda: cpu_linear.linear(a, w),
            )
            if dtype != torch.float32 and cpu_gemv.applies(a, w):  # bf16, a few rows: our
                layouts += (lambda: cpu_gemv.gemv(a, w),)  # kernel (fp32's: cpu_linear's)
            for layout in layouts:
                layout()
            self._rates[key] = flop / min(_best(layout, reps) for layout in layouts)
        return self._rates[key]

    def peak(self, dtype: torch.dtype) -> float:
        return self.rate(4096, 4096, 4096, dtype)

    @property
    def read_bandwidth(self) -> float:
        """Bytes/s reading 1 GiB of fp32 (a sum)."""
        if self._read is None:
            x = torch.ones(2**28)
            self._read = x.numel() * 4 / _best(x.sum, 5)
        return self._read

    @property
    def copy_bandwidth(self) -> float:
        """Bytes/s streamed (read + written) by the better of a 1 GiB fp32 copy and a triad."""
        if self._copy is None:
            x, y, z = torch.ones(2**28), torch.ones(2**28), torch.empty(2**28)
            copy = 2 * x.numel() * 4 / _best(lambda: z.copy_(x), 5)
            triad = 3 * x.numel() * 4 / _best(lambda: torch.add(x, y, out=z), 5)
            del x, y, z
            self._copy = max(copy, triad, _adam_bandwidth())
        return self._copy

    def floor(self, phase: Phase, dtype: torch.dtype) -> float:
        """The roofline: each product at the larger of its FLOP at the dtype's peak and the
        bytes it must read (weights and input once, output written) at the read bandwidth (a
        sum's; where the product itself ran faster, its measured time: a bound above what the
        machine did is no bound); a backward 3x a forward; plus the sweeps at the streaming
        bandwidth."""
        e = dtype.itemsize
        # the peak: the best rate measured at any shape (a large square one, or a phase's own)
        peak = max(
            [self.peak(dtype)] + [self.rate(r, k, n, dtype) for r, k, n, *_ in phase.products]
        )
        seconds = phase.sweep_bytes / self.copy_bandwidth
        for rows, k, n, count, backward in phase.products:
            compute = 2 * rows * k * n / peak
            memory = (k * n + rows * k + rows * n) * e / self.read_bandwidth
            measured = 2 * rows * k * n / self.rate(rows, k, n, dtype)  # never above what ran
            seconds += min(max(compute, memory), measured) * count * (3 if backward else 1)
        return seconds

    def at_shapes(self, phase: Phase, dtype: torch.dtype) -> float:
        """The same products at the rates measured at their own shapes: what they take back to
        back with this machine's BLAS, nothing else in between."""
        seconds = phase.sweep_bytes / self.copy_bandwidth
        for rows, k, n, count, backward in phase.products:
            flop = 2 * rows * k * n * count * (3 if backward else 1)
            seconds += flop / self.rate(rows, k, n, dtype)
        return seconds


def _adam_bandwidth(params: int = 2**26) -> float:
    """Bytes/s of torch's fused Adam step over ``params`` fp32 parameters (28 B each: weight,
    gradient and both moments read, weight and moments written)."""
    weights = [torch.zeros(params, requires_grad=True)]
    weights[0].grad = torch.ones(params)
    optimizer = torch.optim.Adam(weights, lr=1e-3, fused=True)
    optimizer.step()
    return 28 * params / _best(optimizer.step, 5)


def _best(function, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def floors(machine: Machine, phases: list[Phase], dtype: torch.dtype) -> dict[str, float]:
    return {phase.name: machine.floor(phase, dtype) for phase in phases}


def print_machine(machine: Machine, arch: dict) -> None:
    h, v = arch["hidden_size"], arch["vocab_size"]
    print(f"machine: {machine.threads} threads; read {machine.read_bandwidth / 1e9:.1f} GB/s, "
          f"stream {machine.copy_bandwidth / 1e9:.1f} GB/s (read + write)")  # fmt: skip
    print("| product | fp32 GFLOP/s | bf16 GFLOP/s |")
    print("|---|---:|---:|")
    for rows, k, n in ((4096, 4096, 4096), (256, h, v), (8, h, v), (8, h, 4 * h), (256, h, 4 * h)):
        cells = [f"{machine.rate(rows, k, n, dtype) / 1e9:.0f}" for dtype in DTYPES.values()]
        print(f"| {rows} x {k} @ {k} x {n} | " + " | ".join(cells) + " |")


def print_floors(machine: Machine, phases: list[Phase], dtype: torch.dtype, label: str,
                 measured: dict[str, float] | None = None) -> None:  # fmt: skip
    """One row a phase: GFLOP, the roofline floor, the products at their shapes' rates and,
    given measured seconds, the time and the fraction of the floor it reaches. A phase that ran
    faster than its floor (the optimizer's sweep, when this VM streamed faster during the run
    than during the bandwidth measurement: 56 and 75 GB/s on two runs of one day) has its
    measured time as its floor: a bound above what the machine did is no bound."""
    head = "| phase | GFLOP | floor (s) | at shapes (s) |"
    print(f"\n{label}\n" + head + (" measured (s) | floor / measured |" if measured else ""))
    print("|---" * (4 + 2 * bool(measured)) + "|")
    total_floor = total_shapes = 0.0
    for phase in phases:
        floor, shapes = machine.floor(phase, dtype), machine.at_shapes(phase, dtype)
        if measured:
            floor = min(floor, measured[phase.name])
        total_floor, total_shapes = total_floor + floor, total_shapes + shapes
        cells = [phase.name, f"{phase.flop / 1e9:.0f}", f"{floor:.2f}", f"{shapes:.2f}"]
        if measured:
            cells += [f"{measured[phase.name]:.2f}", f"{floor / measured[phase.name]:.0%}"]
        print("| " + " | ".join(cells) + " |")
    cells = ["step", f"{sum(p.flop for p in phases) / 1e9:.0f}", f"{total_floor:.2f}",
             f"{total_shapes:.2f}"]  # fmt: skip
    if measured:
        cells += [f"{measured['step']:.2f}", f"{total_floor / measured['step']:.0%}"]
    print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="560m")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    defaults = StepShape()
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--micro-batch", type=int, default=defaults.micro_batch)
    parser.add_argument("--recompute-old", action="store_true", help="scoring recomputes pi_old")
    parser.add_argument(
        "--from-log", nargs="+", default=[],
        help="bench_ppo_real_shapes.py logs: print each side's median phases beside the floors "
        "(the precision and shape as that run's header line says; the default shape's)",
    )  # fmt: skip
    parser.add_argument(
        "--planner", action="store_true",
        help="also the planner's phase times for this step on one device with this machine's "
        "bf16 figures, beside the floors (and our bf16 side's medians from a --from-log)",
    )  # fmt: skip
    args = parser.parse_args()
    arch = SIZES[args.size]
    machine = Machine(args.threads)
    print_machine(machine, arch)
    shape = (args.prompts_per_step, args.prompt_tokens, args.new_tokens, args.micro_batch)
    bf16_logs = {log: ", bf16, " in Path(log).read_text() for log in args.from_log}
    for log, bf16 in bf16_logs.items():
        for side, measured in medians_of(log).items():
            # every "ours" side but vLLM's runs our rollout engine (bench_ppo_real_shapes.py)
            reuses = not bf16 and side.startswith("ours") and side != "ours (vllm)"
            print_side(machine, args.size, shape, side, reuses, bf16, measured)
            if args.planner and bf16 and side == "ours":
                print_planner(machine, args.size, shape, measured)
    if args.planner and not any(bf16_logs.values()):
        print_planner(machine, args.size, shape, None)
    for name in args.dtype if not args.from_log else ():
        dtype = DTYPES[name]
        phases = step_phases(
            arch, args.prompts_per_step, args.prompt_tokens, args.new_tokens,
            args.micro_batch, recompute_old=args.recompute_old,
        )  # fmt: skip
        print_floors(machine, phases, dtype, f"{args.size}, {name}")


def print_side(
    machine: Machine, size: str, shape: tuple, side: str, reuses: bool, bf16: bool, measured: dict
):
    """One side of bench_ppo_real_shapes.py beside its floors: ``shape`` (prompts, prompt
    tokens, new tokens, micro-batch); ``reuses``: the side reuses the rollout's log-probs as
    pi_old (our fp32 sides with our own rollout engine), where every other side recomputes
    them."""
    phases = step_phases(SIZES[size], *shape, recompute_old=not reuses)
    name = "bf16" if bf16 else "fp32"
    print_floors(machine, phases, DTYPES[name], f"{side}, {size}, {name}", measured)


def planner_phases(machine: Machine, arch: dict, shape: tuple) -> dict[str, float]:
    """The planner's step-time model (``planning/plan.py``) for this step on one device with
    this machine's bf16 figures (its peak the measured bf16 peak, its HBM the read bandwidth),
    summed into the roofline's phases: {rollout, scoring, update: seconds}. The planner models
    bf16 weights (2 B a parameter read per decode step) and no optimizer sweep."""
    from megatron_rlhf.planning import hardware, plan
    from megatron_rlhf.planning.shapes import ModelShape

    prompts, prompt_tokens, new_tokens, micro_batch = shape
    model = ModelShape(name="roofline", **{k: arch[k] for k in ModelShape.__dataclass_fields__
                                           if k in arch})  # fmt: skip
    device = hardware.GPU(
        name=f"this CPU, {machine.threads} threads",
        bf16_tflops=machine.peak(torch.bfloat16) / 1e12,
        memory_gb=1e6,  # the one layout fits: the comparison is about time
        hbm_tb_per_s=machine.read_bandwidth / 1e12,
        nvlink_gb_per_s=1.0,  # unused: one device
    )
    request = plan.PlanRequest(
        models={role: model for role in plan.ROLE_HEADS}, gpus=1, gpu_memory_gb=1e6,
        rollout_sequences=prompts, max_length=prompt_tokens + new_tokens,
        prompt_length=prompt_tokens, micro_batch=micro_batch, reserve_gb=0.0, gpu=device,
    )  # fmt: skip
    phases = {"rollout": 0.0, "scoring": 0.0, "update": 0.0}
    for key, seconds in plan.make_plans(request, top=1).plans[0].seconds.items():
        phase = {"rollout": "rollout", "score": "scoring", "train": "update"}.get(key.split("_")[0])
        if phase is None:
            raise ValueError(f"the planner's {key!r} has no roofline phase")
        phases[phase] += seconds
    return phases


def print_planner(machine: Machine, size: str, shape: tuple, measured: dict | None) -> None:
    """The planner's phase times beside the bf16 floors (and a measured side's medians)."""
    arch = SIZES[size]
    planned = planner_phases(machine, arch, shape)
    phases = {p.name: p for p in step_phases(arch, *shape, recompute_old=True)}
    print(f"\nthe planner's step-time model, {size}, bf16, one device with this machine's figures")
    head = "| phase | planner (s) | floor (s) | planner / floor |"
    print(head + (" measured (s) |" if measured else ""))
    print("|---" * (4 + bool(measured)) + "|")
    for name, seconds in planned.items():
        floor = machine.floor(phases[name], torch.bfloat16)
        cells = [name, f"{seconds:.2f}", f"{floor:.2f}", f"{seconds / floor:.1f}x"]
        cells += [f"{measured[name]:.2f}"] if measured else []
        print("| " + " | ".join(cells) + " |")


def medians_of(log: str) -> dict[str, dict[str, float]]:
    """{side: median seconds of each phase} from the ``seed S rep R side: {...}`` lines of a
    bench_ppo_real_shapes.py log (the update without its optimizer, as phases count it)."""
    runs: dict[str, list[dict]] = {}
    for line in Path(log).read_text().splitlines():
        if line.startswith("seed ") and ": {" in line:
            head, record = line.split(": ", 1)
            runs.setdefault(head.split(" ", 4)[4], []).append(json.loads(record))
    medians = {}
    for side, records in runs.items():
        medians[side] = {k: statistics.median(r[k] for r in records) for k in records[0]}
        medians[side]["update"] -= medians[side]["optimizer"]
    return medians


if __name__ == "__main__":
    main()
