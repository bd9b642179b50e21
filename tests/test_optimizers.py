"""`train.optimizer`, `[train.optimizer_config]` and `[train.lr_schedule]` (protocol/optimizers.py,
trainer/optimizers.py): mlx-lm's optimizers and schedules, with dpool's guarantees.

For every optimizer the curve does not depend on the number of ranks or their shares, a run killed
and resumed from a checkpoint continues exactly (the optimizer's state, whatever its shape, is in the
checkpoint), and the learning rate of each step is the one mlx-lm's `build_schedule` gives.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import pytest
import ring
from jobs import SMALL, job, write_job
from mlx_lm.tuner.utils import build_schedule

import dpool.protocol.messages as m
from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import JobFileError, load_job, parse_job
from dpool.protocol.optimizers import OPTIMIZERS, SCHEDULES
from dpool.trainer import optimizers

STEPS, EVERY = 8, 4
# Each optimizer with settings under which the tiny GPT learns in a few steps, and its peak rate.
SETTINGS: dict[str, tuple[dict[str, Any], float]] = {
    "adam": ({}, 1e-3),
    "adamw": ({"betas": [0.9, 0.95], "weight_decay": 0.1}, 1e-3),
    "sgd": ({"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}, 0.3),
    # The schedule's rate applies (relative_step off) and a first moment is kept: more state to carry.
    "adafactor": ({"relative_step": False, "beta_1": 0.9}, 1e-2),
    "muon": ({}, 2e-2),
}
COSINE = {"name": "cosine_decay", "arguments": [None, STEPS, 1e-5], "warmup": 2}  # None: the optimizer's peak
STEP_DECAY = {"name": "step_decay", "arguments": [None, 0.5, 3], "warmup": 2, "warmup_init": 1e-4}


def small_job(name: str = "o", **train: Any) -> dict[str, Any]:
    """A tiny job (tests/jobs.py) with these train keys; without TINY's warm-up beside a schedule."""
    doc = job(name, train=train)
    if "lr_schedule" in train and "warmup_steps" not in train:
        doc["train"].pop("warmup_steps")
    return doc


def schedule_for(opt: str, shape: dict[str, Any]) -> dict[str, Any]:
    return {**shape, "arguments": [SETTINGS[opt][1], *shape["arguments"][1:]]}


def opt_job(folder: Path, opt: str, shape: dict[str, Any] = COSINE, **sections: Any) -> Path:
    base = {**SMALL, "train": {k: v for k, v in SMALL["train"].items() if k not in ("lr", "warmup_steps")}}
    name = f"{opt}-{shape['name'].replace('_', '-')}"
    return write_job(
        folder, name, base=base,
        train={"steps": STEPS, "micro_batch": 24, "optimizer": opt, "optimizer_config": SETTINGS[opt][0],
               "lr_schedule": schedule_for(opt, shape), **sections.pop("train", {})},
        checkpoint={"every_steps": EVERY, "keep": 10},
        eval={"every_steps": 100, "batches": 1, "sample_every_steps": 100, "sample_tokens": 4}, **sections,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("optimizers")


@pytest.fixture(scope="module")
def env(work) -> dict[str, str]:
    return {"DPOOL_CACHE_DIR": str(work / "tokens")}


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in ring.metrics(run_dir).items()}


def assert_same_curve(a: dict[int, float], b: dict[int, float], tol: float, steps: range = range(1, STEPS + 1)) -> None:
    diffs = {s: abs(a[s] - b[s]) for s in steps}
    worst = max(diffs, key=diffs.__getitem__)
    assert diffs[worst] <= tol, f"step {worst}: {a[worst]} vs {b[worst]} (|diff| {diffs[worst]:.2e} > {tol})"


def mlx_lm_rates(schedule: dict[str, Any], steps: int) -> dict[int, float]:
    """mlx-lm's learning rate at each dpool step: its optimizer evaluates the schedule at its uint64
    step count, which is s - 1 at the s-th update."""
    fn = build_schedule(schedule)
    return {s: fn(mx.array(s - 1, dtype=mx.uint64)).item() for s in range(1, steps + 1)}


# ---------------------------------------------------------------------------------------------
# The tables follow MLX.


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_table_is_its_mlx_class_signature(name: str) -> None:
    table = OPTIMIZERS[name]
    params = dict(inspect.signature(getattr(optim, table.cls)).parameters)
    params.pop("learning_rate")
    assert list(table.args) == list(params), f"{table.cls}: arguments"
    for key, arg in table.args.items():
        default = params[key].default
        assert arg.default == (list(default) if isinstance(default, tuple) else default), f"{table.cls}.{key}"


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"constant"}))
def test_each_schedule_table_is_its_mlx_function_signature(name: str) -> None:
    params = inspect.signature(getattr(optim.schedulers, name)).parameters
    assert [p for p, _ in SCHEDULES[name]] == list(params)
    for p, arg in SCHEDULES[name]:
        default = params[p].default
        assert arg.default == (None if default is inspect.Parameter.empty else default), f"{name}({p})"


def test_the_optimizer_is_the_class_mlx_lm_builds_with_the_config_given() -> None:
    spec = parse_job(small_job(optimizer="sgd", optimizer_config={"momentum": 0.5}))
    opt = optimizers.build(spec.train)
    assert type(opt) is optim.SGD and opt.momentum == 0.5 and opt.dampening == 0.0 and not opt.nesterov
    spec = parse_job(small_job(optimizer="adafactor"))
    assert spec.train.optimizer_config == {k: a.default for k, a in OPTIMIZERS["adafactor"].args.items()}
    assert type(optimizers.build(spec.train)) is optim.Adafactor
    default = optimizers.build(parse_job(small_job(weight_decay=0.2)).train)
    assert type(default) is optim.AdamW and default.betas == [0.9, 0.95] and default.weight_decay == 0.2


@pytest.mark.parametrize("schedule", [
    {"name": "cosine_decay", "arguments": [3e-4, 50, 1e-6], "warmup": 5},
    {"name": "cosine_decay", "arguments": [1e-3, 20]},
    {"name": "linear_schedule", "arguments": [1e-3, 0.0, 30], "warmup": 3, "warmup_init": 1e-5},
    {"name": "exponential_decay", "arguments": [1e-2, 0.9]},
    {"name": "step_decay", "arguments": [1e-3, 0.5, 7], "warmup": 1},
])
def test_each_steps_rate_is_mlx_lms_build_schedule(schedule: dict[str, Any]) -> None:
    spec = parse_job(small_job(steps=60, lr_schedule=schedule))
    rate = optimizers.learning_rate(spec.train)
    assert {s: rate(s) for s in range(1, 61)} == mlx_lm_rates(schedule, 60)


def test_constant_is_mlx_lms_fixed_rate_and_no_schedule_is_dpools_own() -> None:
    spec = parse_job(small_job(steps=10, lr_schedule={"name": "constant", "arguments": [1e-3]}))
    fixed = optim.Adam(learning_rate=1e-3).learning_rate.item()  # mlx-lm without lr_schedule
    assert [optimizers.learning_rate(spec.train)(s) for s in (1, 5, 10)] == [fixed] * 3
    warm = parse_job(small_job(steps=10, lr_schedule={"name": "constant", "arguments": [1e-3], "warmup": 4}))
    assert optimizers.learning_rate(warm.train)(5) == fixed and optimizers.learning_rate(warm.train)(1) == 0.0
    spec = parse_job(small_job(steps=10, lr=1e-3, warmup_steps=2, optimizer="sgd"))
    rate = optimizers.learning_rate(spec.train)
    assert rate(1) == 5e-4 and rate(2) == 1e-3 and rate(10) == pytest.approx(1e-4)  # warm-up, cosine to a tenth


# ---------------------------------------------------------------------------------------------
# The job file.


@pytest.mark.parametrize(("train", "key", "says"), [
    ({"optimizer": "lion"}, "train.optimizer", "'adam', 'adamw', 'sgd', 'adafactor', 'muon'"),
    ({"optimizer": "sgd", "optimizer_config": {"betas": [0.9, 0.99]}}, "train.optimizer_config.betas",
     "allowed: momentum, weight_decay, dampening, nesterov"),
    ({"optimizer_config": {"eps": 1e-6}}, "train.optimizer_config", "only with train.optimizer set"),
    ({"optimizer": "adamw", "weight_decay": 0.1}, "train.weight_decay", "train.optimizer_config.weight_decay"),
    ({"optimizer": "adam", "optimizer_config": {"betas": 0.9}}, "train.optimizer_config.betas", "a list of two numbers"),
    ({"optimizer": "muon", "optimizer_config": {"ns_steps": 2.5}}, "train.optimizer_config.ns_steps", "an integer"),
    ({"optimizer": "sgd", "optimizer_config": {"nesterov": True}}, "train.optimizer_config.nesterov", "momentum > 0"),
    ({"lr_schedule": {"name": "cosine", "arguments": [1e-3, 10]}}, "train.lr_schedule.name", "'cosine_decay'"),
    ({"lr_schedule": {"name": "cosine_decay", "arguments": [1e-3]}}, "train.lr_schedule.arguments",
     "2 to 3 numbers: cosine_decay(init, decay_steps, end=0.0)"),
    ({"lr_schedule": {"name": "step_decay", "arguments": [1e-3, 0.5, 10, 1]}}, "train.lr_schedule.arguments", "3 numbers"),
    ({"lr_schedule": {"name": "linear_schedule", "arguments": [1e-3, 0.0, 0]}}, "train.lr_schedule.arguments[2] (steps)", ">= 1"),
    ({"lr_schedule": {"name": "constant", "arguments": [1e-3], "warmup": -1}}, "train.lr_schedule.warmup", ">= 0"),
    ({"lr_schedule": {"name": "constant", "arguments": [1e-3], "decay": 1}}, "train.lr_schedule.decay", "allowed: name, arguments"),
    ({"lr": 1e-3, "lr_schedule": {"name": "constant", "arguments": [1e-3]}}, "train.lr", "first argument is the peak"),
    ({"warmup_steps": 5, "lr_schedule": {"name": "constant", "arguments": [1e-3]}}, "train.warmup_steps", "lr_schedule.warmup"),
])
def test_bad_optimizer_keys_are_refused_naming_the_key(train: dict[str, Any], key: str, says: str) -> None:
    doc = small_job("bad", **train)
    with pytest.raises(JobFileError) as e:
        parse_job(doc, source="job.toml")
    assert e.value.key == key, str(e.value)
    assert says in str(e.value) and str(e.value).startswith("job.toml: ")


def test_jobs_without_the_new_keys_keep_their_hash() -> None:
    """Hashes computed by the code before the optimizer keys existed, for two fixed jobs."""
    gpt = {"name": "opt-hash", "model": {"layers": 2, "dim": 32, "heads": 2},
           "train": {"steps": 20, "global_batch": 8, "lr": 1e-3, "warmup_steps": 5, "weight_decay": 0.05}}
    lm = {"name": "opt-hash-lm", "model": {"kind": "mlx_lm", "path": "model"}, "data": {"source": "data"},
          "train": {"steps": 100, "global_batch": 4, "lr": 1e-5, "warmup_steps": 0}}
    assert parse_job(gpt).training_hash() == "42a652b47b7823aa"
    assert parse_job(lm).training_hash() == "3113ac7a9e2b719c"


def test_the_hash_holds_what_the_optimizer_does_and_nothing_else() -> None:
    def h(**train: Any) -> str:
        return parse_job({"name": "h", "train": {"steps": 20, **train}}).training_hash()

    plain = h(warmup_steps=2)
    assert h(warmup_steps=2, optimizer="adamw") != plain
    assert h(warmup_steps=2, optimizer="adamw") == h(warmup_steps=2, optimizer="adamw", optimizer_config={"eps": 1e-8}), "defaults filled in"
    assert h(warmup_steps=2, optimizer="adamw", optimizer_config={"eps": 1e-7}) != h(warmup_steps=2, optimizer="adamw")
    cosine = {"name": "cosine_decay", "arguments": [1e-3, 20]}
    assert h(lr_schedule=cosine) != plain
    assert h(lr_schedule=cosine) == h(lr_schedule={**cosine, "arguments": [1e-3, 20.0, 0.0], "warmup": 0}), "one meaning, one hash"
    assert h(lr_schedule=cosine) != h(lr_schedule={**cosine, "warmup": 2})


def test_the_keys_travel_on_the_wire_and_in_job_files_unchanged(tmp_path: Path) -> None:
    spec = parse_job(small_job(
        "wire", optimizer="adafactor", optimizer_config={"eps": [1e-30, 1e-3], "beta_1": 0.9},
        lr_schedule={"name": "step_decay", "arguments": [1e-3, 0.5, 3], "warmup": 2, "warmup_init": 1e-5},
    ))
    got, _ = m.decode(m.Submit(job=spec.to_dict(), source="job.toml").to_frames())
    again = parse_job(got.job, source="wire")  # type: ignore[attr-defined]
    assert again == spec and again.training_hash() == spec.training_hash()
    path = tmp_path / "job.toml"
    path.write_text(dump_job(spec))
    assert "[train.lr_schedule]" in path.read_text() and "[train.optimizer_config]" in path.read_text()
    assert load_job(path).train == spec.train


# ---------------------------------------------------------------------------------------------
# Training: every optimizer on 1 and 3 ranks, killed and resumed.


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_each_optimizer_keeps_the_curve_across_ranks_and_a_resume(opt: str, work: Path, env: dict[str, str]) -> None:
    path = opt_job(work, opt)
    logs = work / "logs"
    ref = work / opt / "ref"
    ring.run(path, str(ref), 1, logs, env=env)
    reference = losses(ref)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1] - 0.3, f"{opt} learns: {reference}"
    expected = mlx_lm_rates(schedule_for(opt, COSINE), STEPS)
    assert {s: r["lr"] for s, r in ring.metrics(ref).items()} == expected, "each step's rate is mlx-lm's, exactly"

    three = work / opt / "three"
    ring.run(path, str(three / "rank{rank}"), 3, logs, shares=[4, 8, 12], env=env)
    assert_same_curve(reference, losses(three / "rank0"), 1e-4)

    killed = work / opt / "killed"
    ring.kill_at_checkpoint(path, killed, EVERY, logs, env=env)
    assert not (killed / "checkpoints" / f"step-{STEPS}").exists(), "killed before the last checkpoint"
    resumed = ring.run(path, str(killed), 1, logs, env=env)
    assert f'"resume_step":{EVERY}' in resumed.output(0)
    assert_same_curve(reference, losses(killed), 1e-6, steps=range(EVERY + 1, STEPS + 1))
    assert {s: r["lr"] for s, r in ring.metrics(killed).items()} == expected


def test_a_second_schedule_on_three_ranks(work: Path, env: dict[str, str]) -> None:
    """step_decay after a warm-up from warmup_init: the rates mlx-lm gives, the same curve on 3 ranks."""
    path = opt_job(work, "adamw", STEP_DECAY)
    ref, three = work / "decay" / "ref", work / "decay" / "three"
    ring.run(path, str(ref), 1, work / "logs", env=env)
    ring.run(path, str(three / "rank{rank}"), 3, work / "logs", shares=[12, 7, 5], env=env)
    rates = {s: r["lr"] for s, r in ring.metrics(ref).items()}
    assert rates == mlx_lm_rates(schedule_for("adamw", STEP_DECAY), STEPS)
    assert rates[1] == pytest.approx(1e-4), "the warm-up starts at warmup_init"
    assert rates[4] == rates[6] == 2 * rates[7], "from the peak, halved every 3 steps"
    assert_same_curve(losses(ref), losses(three / "rank0"), 1e-4)


def test_diloco_gathers_and_resumes_an_adafactor_state(work: Path, env: dict[str, str]) -> None:
    """Inner optimizer states of any shape (Adafactor's factored moments) are gathered across ranks
    for a checkpoint and resumed: 1 worker and 2 unequal ones, and a resume of the 2, on one curve."""
    path = opt_job(work, "adafactor", COSINE, sync={"mode": "diloco", "replicas": 3, "inner_steps": 2})
    one, two = work / "diloco" / "one", work / "diloco" / "two"
    ring.run(path, str(one / "r{rank}"), 1, work / "logs", env=env)
    ring.run(path, str(two / "r{rank}"), 2, work / "logs", shares=[16, 8], env=env)
    assert_same_curve(losses(one / "r0"), losses(two / "r0"), 1e-4)
    again = work / "diloco" / "again"
    for rank in range(2):  # the 2-rank run as if stopped after step 4: its step-8 checkpoints gone
        shutil.copytree(two / f"r{rank}", again / f"r{rank}", ignore=shutil.ignore_patterns(f"step-{STEPS}", "cache"))
    resumed = ring.run(path, str(again / "r{rank}"), 2, work / "logs", shares=[16, 8], env=env)
    assert f'"resume_step":{EVERY}' in resumed.output(0)
    assert_same_curve(losses(two / "r0"), losses(again / "r0"), 1e-6, steps=range(EVERY + 1, STEPS + 1))
