"""Per-role TP/PP layouts of ``train-ppo`` (the ``parallel:`` section) and their validation.

Every PPO role, and the rollout, may sit in its own tensor/pipeline layout over the same world::

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
``parallel.tp/pp``; a config with only ``parallel.tp/pp`` gives every role that layout (the
pre-per-role behaviour). This module is pure (no torch.distributed): planners import
:func:`resolve_layouts` / :func:`layouts_to_dict` to read or emit a layout without a launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlhf.utils import InputError

ROLES = ("actor", "reference", "critic", "reward", "rollout")
"""The roles that own a layout; ``rollout`` is the actor's generation-time copy."""

INHERITS_FROM_ACTOR = ("reference", "rollout")


@dataclass(kw_only=True)
class RoleLayoutConfig:
    """One role's layout as written in the config; None inherits (see the module docstring)."""

    tp: int | None = None
    """Tensor-parallel size of this role (heads and vocabulary split over tp ranks)."""
    pp: int | None = None
    """Pipeline-parallel size of this role (its decoder layers split over pp stages)."""


@dataclass(kw_only=True)
class ParallelSection:
    """The ``parallel:`` section: defaults, then an optional layout per role."""

    tp: int = 1
    """Default tensor-parallel size of every role that sets none."""
    pp: int = 1
    """Default pipeline-parallel size of every role that sets none."""
    sequence_parallel: bool = False
    """Split LayerNorm/dropout activations along the sequence over each role's TP group."""
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
    """A resolved layout of one role over a world of ``tp * pp * dp`` ranks."""

    tp: int
    pp: int
    dp: int

    def as_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}


def resolve_tp_pp(parallel: ParallelSection, role: str) -> tuple[int, int]:
    """(tp, pp) of ``role`` after inheritance; no divisibility check."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
    own: RoleLayoutConfig = getattr(parallel, role)
    if role in INHERITS_FROM_ACTOR:
        base_tp, base_pp = resolve_tp_pp(parallel, "actor")
    else:
        base_tp, base_pp = parallel.tp, parallel.pp
    return (own.tp if own.tp is not None else base_tp, own.pp if own.pp is not None else base_pp)


def resolve_layout(
    parallel: ParallelSection,
    role: str,
    world_size: int,
    num_heads: int | None = None,
    num_layers: int | None = None,
) -> Layout:
    """The validated layout of one role (InputError naming ``parallel.<role>`` and the fix)."""
    problems = layout_problems(parallel, role, world_size, num_heads, num_layers)
    if problems:
        raise InputError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
    tp, pp = resolve_tp_pp(parallel, role)
    return Layout(tp=tp, pp=pp, dp=world_size // (tp * pp))


def resolve_layouts(
    parallel: ParallelSection,
    world_size: int,
    archs: dict | None = None,
    roles: tuple[str, ...] = ROLES,
) -> dict[str, Layout]:
    """Every role's layout; all problems of all roles in one InputError.

    ``archs`` maps roles to architectures (anything with ``num_heads``/``num_layers``); the
    rollout is checked against the actor's. Roles absent from ``archs`` are checked against
    the world size only.
    """
    archs = dict(archs or {})
    if "actor" in archs:
        archs.setdefault("rollout", archs["actor"])
    problems = []
    for role in roles:
        arch = archs.get(role)
        problems += layout_problems(
            parallel,
            role,
            world_size,
            getattr(arch, "num_heads", None),
            getattr(arch, "num_layers", None),
        )
    if problems:
        raise InputError("invalid parallel layout:\n  - " + "\n  - ".join(problems))
    return {role: resolve_layout(parallel, role, world_size) for role in roles}


def layout_problems(
    parallel: ParallelSection,
    role: str,
    world_size: int,
    num_heads: int | None = None,
    num_layers: int | None = None,
) -> list[str]:
    """What is wrong with one role's layout (empty when it is valid)."""
    tp, pp = resolve_tp_pp(parallel, role)
    key = f"parallel.{role}"
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
            f"{[d for d in range(1, num_heads + 1) if num_heads % d == 0]}"
        )
    if num_layers is not None and num_layers % pp:
        problems.append(
            f"{key}: num_layers {num_layers} is not divisible by pp={pp}: pick {key}.pp among "
            f"{[d for d in range(1, num_layers + 1) if num_layers % d == 0]}"
        )
    return problems


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
