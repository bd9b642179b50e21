"""A job's optimizer and learning-rate schedule, as `mlx_lm lora` takes them: the tables and checks.

`train.optimizer` names one of mlx.optimizers' classes and `[train.optimizer_config]` holds that
class's keyword arguments; the trainer builds `getattr(mlx.optimizers, CLASS)(learning_rate=...,
**config)`, as mlx-lm's `lora.py` does. `[train.lr_schedule]` is mlx-lm's `lr_schedule`: a schedule
of `mlx.optimizers.schedulers` by name and positional arguments (the first is the peak), joined
after `warmup` steps of a linear ramp from `warmup_init` (`mlx_lm.tuner.utils.build_schedule`).

The tables mirror MLX's signatures (tests/test_optimizers.py compares them with `inspect.signature`
of the installed MLX, so a change there fails a test here). Pure: no MLX; errors are `OptionError`
(a key below `train.`, what was given, what is allowed), which the job file loader reports with its
file name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dpool.protocol.schema import MAX_INT


class OptionError(ValueError):
    """`key` (below `train.`) = `given` is not allowed: `allowed` says what is."""

    def __init__(self, key: str, given: Any, allowed: str) -> None:
        super().__init__(f"train.{key} = {given!r}: {allowed}")
        self.key, self.given, self.allowed = key, given, allowed


@dataclass(frozen=True, slots=True)
class Arg:
    """One keyword argument: its kind ('float', 'int', 'bool', 'pair' of floats, or 'float?', a
    float that may be left unset), MLX's default, and the range dpool accepts (inclusive)."""

    kind: str
    default: Any
    lo: float = -math.inf
    hi: float = math.inf


@dataclass(frozen=True, slots=True)
class Optimizer:
    cls: str  # the class of mlx.optimizers
    args: dict[str, Arg]


BETA = {"lo": 0.0, "hi": 0.999999}
OPTIMIZERS: dict[str, Optimizer] = {
    "adam": Optimizer("Adam", {
        "betas": Arg("pair", [0.9, 0.999], **BETA), "eps": Arg("float", 1e-8, lo=0.0), "bias_correction": Arg("bool", False),
    }),
    "adamw": Optimizer("AdamW", {
        "betas": Arg("pair", [0.9, 0.999], **BETA), "eps": Arg("float", 1e-8, lo=0.0),
        "weight_decay": Arg("float", 0.01, lo=0.0), "bias_correction": Arg("bool", False),
    }),
    "sgd": Optimizer("SGD", {
        "momentum": Arg("float", 0.0, **BETA), "weight_decay": Arg("float", 0.0, lo=0.0),
        "dampening": Arg("float", 0.0, lo=0.0, hi=1.0), "nesterov": Arg("bool", False),
    }),
    "adafactor": Optimizer("Adafactor", {
        "eps": Arg("pair", [1e-30, 1e-3], lo=0.0), "clip_threshold": Arg("float", 1.0, lo=0.0),
        "decay_rate": Arg("float", -0.8, lo=-1.0, hi=0.0), "beta_1": Arg("float?", None, **BETA),
        "weight_decay": Arg("float", 0.0, lo=0.0), "scale_parameter": Arg("bool", True),
        "relative_step": Arg("bool", True), "warmup_init": Arg("bool", False),
    }),
    "muon": Optimizer("Muon", {
        "momentum": Arg("float", 0.95, **BETA), "weight_decay": Arg("float", 0.01, lo=0.0),
        "nesterov": Arg("bool", True), "ns_steps": Arg("int", 5, lo=1, hi=100),
    }),
}


def _value(arg: Arg, v: Any, key: str) -> Any:
    """`v` checked against `arg`, in its normal form (floats as float, a pair as a list of two)."""
    number = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    rng = f" in [{arg.lo:g}, {arg.hi:g}]" if math.isfinite(arg.lo) and math.isfinite(arg.hi) else (
        f" >= {arg.lo:g}" if math.isfinite(arg.lo) else ""
    )
    if arg.kind == "bool":
        if isinstance(v, bool):
            return v
        raise OptionError(key, v, "must be true or false")
    if arg.kind == "int":  # the wire carries no integer beyond 2^53 - 1
        top = min(arg.hi, MAX_INT)
        if number and float(v).is_integer() and arg.lo <= v <= top:
            return int(v)
        raise OptionError(key, v, f"must be an integer{rng if math.isfinite(arg.hi) else f'{rng} (and below 2^53)'}")
    if arg.kind == "pair":
        if isinstance(v, list | tuple) and len(v) == 2 and all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and arg.lo <= x <= arg.hi for x in v
        ):
            return [float(x) for x in v]
        raise OptionError(key, v, f"must be a list of two numbers{rng}")
    if v is None and arg.kind == "float?":  # unset (TOML has no null: absent from the table; on the wire, None)
        return None
    if number and arg.lo <= v <= arg.hi:
        return float(v)
    raise OptionError(key, v, f"must be a finite number{rng}")


def optimizer_config(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """The full keyword arguments of optimizer `name`: `given` checked, MLX's defaults filled in."""
    table = OPTIMIZERS[name].args
    for key in given:
        if key not in table:
            raise OptionError(f"optimizer_config.{key}", given[key], f"not an argument of {name}; allowed: " + ", ".join(table))
    out = {k: _value(a, given[k], f"optimizer_config.{k}") if k in given else a.default for k, a in table.items()}
    if name == "sgd" and out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
        # MLX's own rule (SGD raises on it): Nesterov needs a momentum and no dampening.
        raise OptionError("optimizer_config.nesterov", True, "needs optimizer_config.momentum > 0 and dampening = 0 (sgd)")
    return out


# ---------------------------------------------------------------------------------------------
# Schedules: mlx.optimizers.schedulers' functions by name, each argument (name, kind, default or
# None when required). "constant" is dpool's: mlx-lm without a schedule, a fixed learning rate.

PEAK = Arg("float", None, lo=0.0, hi=10.0)  # the first argument: the learning rate the schedule starts from
SCHEDULES: dict[str, tuple[tuple[str, Arg], ...]] = {
    "cosine_decay": (("init", PEAK), ("decay_steps", Arg("int", None, lo=1)), ("end", Arg("float", 0.0, lo=0.0, hi=10.0))),
    "exponential_decay": (("init", PEAK), ("decay_rate", Arg("float", None, lo=0.0))),
    "linear_schedule": (("init", PEAK), ("end", Arg("float", None, lo=0.0, hi=10.0)), ("steps", Arg("int", None, lo=1))),
    "step_decay": (("init", PEAK), ("decay_rate", Arg("float", None, lo=0.0)), ("step_size", Arg("int", None, lo=1))),
    "constant": (("lr", PEAK),),
}
SCHEDULE_KEYS = ("name", "arguments", "warmup", "warmup_init")


@dataclass(frozen=True, kw_only=True, slots=True)
class LrSchedule:
    """`[train.lr_schedule]`: the learning rate of step s (1-based) is `build_schedule(this)(s - 1)`."""

    name: str  # a key of SCHEDULES
    arguments: tuple[float | int, ...]  # every positional argument, defaults filled in
    warmup: int = 0  # steps of linear warm-up before the schedule starts (mlx-lm: boundary warmup + 1)
    warmup_init: float = 0.0  # the warm-up's first learning rate


def lr_schedule(given: dict[str, Any]) -> LrSchedule:
    """`[train.lr_schedule]` checked, in its normal form (every argument given, each of its kind)."""
    for key in given:
        if key not in SCHEDULE_KEYS:
            raise OptionError(f"lr_schedule.{key}", given[key], "unknown key; allowed: " + ", ".join(SCHEDULE_KEYS))
    name = given.get("name")
    if name not in SCHEDULES:
        raise OptionError("lr_schedule.name", name, "must be one of " + ", ".join(repr(n) for n in SCHEDULES))
    params = SCHEDULES[name]
    args = given.get("arguments")
    required = sum(a.default is None for _, a in params)
    signature = f"{name}({', '.join(p if a.default is None else f'{p}={a.default}' for p, a in params)})"
    if not isinstance(args, list | tuple) or not required <= len(args) <= len(params):
        count = f"{required}" if required == len(params) else f"{required} to {len(params)}"
        raise OptionError("lr_schedule.arguments", args, f"must be a list of {count} numbers: {signature}")
    values = tuple(
        _value(a, args[i], f"lr_schedule.arguments[{i}] ({p})") if i < len(args) else a.default for i, (p, a) in enumerate(params)
    )
    warmup = given.get("warmup", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int | float) or not float(warmup).is_integer() or not 0 <= warmup < 2**53:
        raise OptionError("lr_schedule.warmup", warmup, "must be an integer >= 0 (steps)")
    warmup_init = _value(Arg("float", 0.0, lo=0.0, hi=10.0), given.get("warmup_init", 0.0), "lr_schedule.warmup_init")
    return LrSchedule(name=name, arguments=values, warmup=int(warmup), warmup_init=warmup_init)
