"""Layouts: how models are split over a launch's ranks, as written, resolved and validated.

Three things live here, and nowhere else:

- the ``parallel:`` config section: :class:`LayoutConfig` for a command that loads one model
  (``train-sft``, ``train-reward``), :class:`ParallelSection` for ``train-ppo``, where every
  role may have its own layout; the flag commands write the same keys as ``--parallel
  [ROLE.]tp=N`` (:func:`add_parallel_arguments`);
- :class:`Layout`, the one resolved layout (tp, pp, dp, sequence parallelism) that everything
  downstream takes: process groups, the memory planner, reports;
- :func:`validate_layouts`, the one validator every command's layout goes through.

train-ppo's section, with every role in its own tensor/pipeline layout over the same world::

    parallel:
      tp: 1            # default for every role
      pp: 1
      actor:     {tp: 2, pp: 2}
      reference: {tp: 2, pp: 2}   # default: the actor's layout
      critic:    {tp: 2, pp: 1}
      reward:    {tp: 1, pp: 1}
      rollout:   {tp: 2, pp: 1}   # the generation layout; default: the actor's

Each role's data-parallel size is ``world / (tp * pp)``. A field left out of a role inherits:
reference and rollout from the actor's resolved layout, actor/critic/reward from
``parallel.tp/pp``; a config with only ``parallel.tp/pp`` gives every role that layout. This
module is pure (no torch): config schemas and planners import it without a launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_rlhf.utils import InputError

ROLES = ("actor", "reference", "critic", "reward", "rollout")
"""The roles that own a layout in train-ppo; ``rollout`` is the actor's generation-time copy."""

INHERITS_FROM_ACTOR = ("reference", "rollout")


@dataclass(kw_only=True)
class LayoutConfig:
    """The ``parallel:`` section of a command that trains one model (``train-sft``,
    ``train-reward``); train-ppo's :class:`ParallelSection` adds a layout per role."""

    tp: int = 1
    """Tensor-parallel size (train-ppo: of every role that sets none): attention heads and the
    vocabulary are split over tp ranks."""
    pp: int = 1
    """Pipeline-parallel size (train-ppo: of every role that sets none): consecutive decoder
    layers are split over pp stages."""
    sequence_parallel: bool = False
    """Split LayerNorm/dropout activations along the sequence over the TP group (tp > 1;
    train-ppo: every role's)."""


@dataclass(kw_only=True)
class RoleLayoutConfig:
    """One role's layout as written in the config; None inherits (see the module docstring)."""

    tp: int | None = None
    """Tensor-parallel size of this role (heads and vocabulary split over tp ranks)."""
    pp: int | None = None
    """Pipeline-parallel size of this role (its decoder layers split over pp stages)."""


@dataclass(kw_only=True)
class ParallelSection(LayoutConfig):
    """train-ppo's ``parallel:`` section: the defaults (``tp``, ``pp``, ``sequence_parallel``
    for every role), then an optional layout per role."""

    actor: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    """The trained policy (its training layout)."""
    reference: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    """The frozen reference policy of the KL term; default: the actor's layout."""
    critic: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    """The trained value model."""
    reward: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    """The frozen reward or Advantage Model."""
    rollout: RoleLayoutConfig = field(default_factory=RoleLayoutConfig)
    """The actor's generation layout (weights resharded into it before each rollout);
    default: the actor's training layout (no resharding)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one model is split over a world of ``tp * pp * dp`` ranks: the one resolved layout.

    Made by :func:`validate_layouts` (or, for a layout the caller has already checked, such
    as a planner's study row, directly); process groups (``distributed/groups.py``), the
    memory planner and the reports all take it. ``sequence_parallel`` is what the config
    asked for; the model applies it only where tp > 1 (``models/bloom/config.py``), as
    Megatron-Core has nothing to split the sequence over at tp = 1.
    """

    tp: int
    """Tensor-parallel size: each TP rank holds ``1/tp`` of the heads and the vocabulary."""
    pp: int
    """Pipeline-parallel size: each stage holds ``1/pp`` of the decoder layers."""
    dp: int
    """Data-parallel size: copies of the model, each fed its own rows of the batch."""
    sequence_parallel: bool = False
    """Activations outside attention/MLP split along the sequence over the TP group."""
    first_rank: int = 0
    """The layout's ranks are ``[first_rank, first_rank + tp * pp * dp)`` of the world: the
    whole world except in train-ppo's disaggregated placement, where the rollout engine holds
    the last ``placement.rollout_ranks`` ranks and the training roles the others."""

    @property
    def size(self) -> int:
        """Ranks the layout spans."""
        return self.tp * self.pp * self.dp

    def holds(self, rank: int) -> bool:
        """Whether global ``rank`` is one of the layout's."""
        return self.first_rank <= rank < self.first_rank + self.size

    def as_dict(self) -> dict:
        """The shape as reports print it (``{"tp", "pp", "dp"}``)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}


def _layout_key(role: str) -> str:
    """The config key of ``role``'s layout: ``parallel`` for the one layout of a command that
    loads one model (role ``""``), ``parallel.<role>`` otherwise (``--parallel [ROLE.]tp=N``
    on the flag commands)."""
    return f"parallel.{role}" if role else "parallel"


def validate_layouts(
    shapes: Mapping[str, tuple[int, int]],
    world_size: int,
    archs: Mapping[str, object] | None = None,
    *,
    sequence_parallel: bool = False,
) -> dict[str, Layout]:
    """The one layout validator: ``{role: (tp, pp)}`` over ``world_size`` ranks as
    ``{role: Layout}``, or one InputError listing every problem of every role.

    Every command's layout goes through here before any process group or model is built, so
    a bad layout is a one-line-per-problem error naming the key (:func:`_layout_key`) and the
    fix, not a failure deep inside Megatron-Core. ``archs`` maps a role to its model
    (anything with ``num_heads`` and ``num_layers``); a role without one is checked against
    the world size only. What is checked, and why:

    - tp and pp are at least 1;
    - tp * pp divides the world size: the quotient is the data-parallel size, and every rank
      must hold one whole copy's share;
    - tp divides the attention heads: each TP rank computes whole heads;
    - pp divides the decoder layers: every pipeline stage holds as many layers.

    ``sequence_parallel`` is carried into every Layout unchecked: at tp = 1 it has no effect
    (see :class:`Layout`), and train-ppo's planner writes it for every role.
    """
    archs = archs or {}
    problems: list[str] = []
    for role, (tp, pp) in shapes.items():
        arch = archs.get(role)
        problems += _problems(
            _layout_key(role),
            tp,
            pp,
            world_size,
            getattr(arch, "num_heads", None),
            getattr(arch, "num_layers", None),
        )
    if problems:
        raise InputError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
    return {
        role: Layout(tp=tp, pp=pp, dp=world_size // (tp * pp), sequence_parallel=sequence_parallel)
        for role, (tp, pp) in shapes.items()
    }


def _problems(
    key: str, tp: int, pp: int, world_size: int, num_heads: int | None, num_layers: int | None
) -> list[str]:
    """What is wrong with one layout (empty when it is valid); see :func:`validate_layouts`."""
    if tp < 1 or pp < 1:
        return [f"{key}: tp={tp} and pp={pp} must be >= 1"]
    problems = []
    if world_size % (tp * pp):
        problems.append(
            f"{key}: world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp};"
            f" launch a multiple of {tp * pp} processes or change {key}.tp/pp"
        )
    if num_heads is not None and num_heads % tp:
        problems.append(
            f"{key}: num_heads {num_heads} is not divisible by tp={tp}: pick {key}.tp among "
            f"{divisors(num_heads)}"
        )
    if num_layers is not None and num_layers % pp:
        problems.append(
            f"{key}: num_layers {num_layers} is not divisible by pp={pp}: pick {key}.pp among "
            f"{divisors(num_layers)}"
        )
    return problems


def divisors(n: int) -> list[int]:
    """The values that divide ``n``: the tp (of the heads) or pp (of the layers) to pick among."""
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_layouts(
    parallel: ParallelSection,
    world_size: int,
    archs: Mapping[str, object] | None = None,
    roles: tuple[str, ...] = ROLES,
) -> dict[str, Layout]:
    """train-ppo's layouts: each of ``roles`` after inheritance (see the module docstring),
    through :func:`validate_layouts`; the rollout is checked against the actor's model."""
    archs = dict(archs or {})
    if "actor" in archs:
        archs.setdefault("rollout", archs["actor"])
    shapes = {role: _inherited_shape(parallel, role) for role in roles}
    return validate_layouts(shapes, world_size, archs, sequence_parallel=parallel.sequence_parallel)


def _inherited_shape(parallel: ParallelSection, role: str) -> tuple[int, int]:
    """(tp, pp) of ``role`` after inheritance; no divisibility check."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
    own: RoleLayoutConfig = getattr(parallel, role)
    if role in INHERITS_FROM_ACTOR:
        base_tp, base_pp = _inherited_shape(parallel, "actor")
    else:
        base_tp, base_pp = parallel.tp, parallel.pp
    return (own.tp if own.tp is not None else base_tp, own.pp if own.pp is not None else base_pp)


def layouts_to_dict(layouts: dict[str, Layout], default_tp: int = 1, default_pp: int = 1) -> dict:
    """The ``parallel:`` section that reproduces ``layouts`` (for ``yaml.safe_dump``)."""
    section: dict = {"tp": default_tp, "pp": default_pp}
    for role, layout in layouts.items():
        section[role] = {"tp": layout.tp, "pp": layout.pp}
    return section


PARALLEL_FLAG_HELP = (
    "layouts as KEY=N pairs: tp=N pp=N set every model's; ROLE.tp=N ROLE.pp=N one role's "
    "(roles: {roles})"
)


def add_parallel_arguments(parser, roles: tuple[str, ...] = ()) -> None:
    """``--parallel [ROLE.]tp=N [ROLE.]pp=N ...`` and its shorthand ``--tp N --pp N``: the one
    layout dialect of the flag commands (YAML commands write the same keys under
    ``parallel:``). Read them back with :func:`parallel_from_args`."""
    help_roles = ", ".join(roles) if roles else "none: one model"
    parser.add_argument(
        "--parallel",
        nargs="+",
        default=[],
        metavar="[ROLE.]tp|pp=N",
        help=PARALLEL_FLAG_HELP.format(roles=help_roles),
    )
    parser.add_argument("--tp", type=int, help="shorthand for --parallel tp=N")
    parser.add_argument("--pp", type=int, help="shorthand for --parallel pp=N")


def parallel_from_args(args, roles: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """{role: (tp, pp)} from ``--parallel``/``--tp``/``--pp`` (key ``""`` when the command has
    no roles); also sets ``args.tp``/``args.pp`` to the default layout. InputError names the
    flag and the fix."""
    default = {"tp": 1, "pp": 1}
    per_role: dict[str, dict[str, int]] = {role: {} for role in roles}
    given: set[str] = set()
    for item in args.parallel:
        key, sep, value = item.partition("=")
        role, _, field = key.rpartition(".")
        if not sep or field not in ("tp", "pp"):
            raise InputError(
                f"--parallel {item}: expected [ROLE.]tp=N or [ROLE.]pp=N, e.g. --parallel tp=2"
                + (f" {roles[0]}.tp=1" if roles else "")
            )
        if role and role not in roles:
            known = ", ".join(roles) if roles else "none (it loads one model: use tp=N/pp=N)"
            raise InputError(f"--parallel {item}: unknown role {role!r}; roles: {known}")
        try:
            number = int(value)
        except ValueError:
            raise InputError(f"--parallel {item}: {value!r} is not an integer") from None
        if number < 1:
            raise InputError(f"--parallel {item}: must be >= 1")
        if key in given:
            raise InputError(f"--parallel sets {key} twice; give it once")
        given.add(key)
        (per_role[role] if role else default)[field] = number
    for field in ("tp", "pp"):
        shorthand = getattr(args, field)
        if shorthand is None:
            continue
        if field in given:
            raise InputError(f"--{field} {shorthand} and --parallel {field}=...: give one")
        if shorthand < 1:
            raise InputError(f"--{field} {shorthand}: must be >= 1")
        default[field] = shorthand
    args.tp, args.pp = default["tp"], default["pp"]
    if not roles:
        return {"": (default["tp"], default["pp"])}
    return {
        role: (own.get("tp", default["tp"]), own.get("pp", default["pp"]))
        for role, own in per_role.items()
    }


def check_global_batch(global_batch: int, key: str, layouts: dict[str, Layout]) -> None:
    """``global_batch`` rows must split evenly over every role's data-parallel ranks."""
    bad = {role: layout.dp for role, layout in layouts.items() if global_batch % layout.dp}
    if bad:
        detail = ", ".join(f"{role} dp={dp}" for role, dp in bad.items())
        raise InputError(
            f"{key}={global_batch} (the global batch) is not divisible by the data-parallel "
            f"size of {detail}; pick a multiple of "
            f"{_lcm([layout.dp for layout in layouts.values()])}"
        )


def _lcm(values: list[int]) -> int:
    from math import lcm

    return lcm(*values) if values else 1
