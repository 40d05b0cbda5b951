"""A sweep file names a base config, the points to run and the Slurm resources:

    name: lr-sweep
    base: configs/demo.yaml
    run_root: runs/sweeps
    overrides: [train.max_steps=200]           # every point
    grid: {train.lr: [1.0e-3, 3.0e-3], parallel.tp: [1, 2]}   # the cartesian product...
    points: [{run.seed: 1}, {run.seed: 2}]     # ...times each of these (either may be absent)
    slurm: {nodes: 1, gpus_per_node: 8, time: "02:00:00", partition: gpu, ...}

Every point is resolved and checked (unknown keys, the TP x DP layout of nodes x processes)
before anything is written or submitted.
"""
import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megalite.hf.convert import pretrained_model
from megalite.run_config import Config, given_keys, load_config
from megalite.plan import plan_config
from megalite.typed_config import ConfigError, from_dict


@dataclass(frozen=True)
class SlurmConfig:
    nodes: int = 1  # nodes per run (each array task): torchrun's --nnodes
    gpus_per_node: int = 0  # GPUs per node (#SBATCH --gpus-per-node); 0: CPU processes (gloo)
    procs_per_node: int = 0  # processes per node; 0: gpus_per_node (CPU runs: set it)
    # CPUs per node's task (#SBATCH and srun --cpus-per-task: since Slurm 22.05 srun does not
    # inherit it), shared by that node's processes
    cpus_per_task: int = 8
    time: str = "01:00:00"  # each array task's time limit (#SBATCH --time)
    partition: str = ""  # #SBATCH --partition, if set
    account: str = ""  # #SBATCH --account, if set
    qos: str = ""  # #SBATCH --qos, if set
    constraint: str = ""  # #SBATCH --constraint (node features), if set
    throttle: int = 0  # at most this many array tasks at once; 0: no limit
    signal: str = "USR1@90"  # sent ahead of the time limit: checkpoint, requeue, resume
    extra_sbatch: list[str] = field(default_factory=list)  # e.g. ["--exclusive"]
    setup: list[str] = field(default_factory=list)  # shell lines, e.g. module load / venv
    python: str = "python"  # the interpreter that runs torchrun on each node
    max_requeues: int = 20  # a run preempted more often than this stays stopped
    # torchrun --max-restarts: the ranks restarted after one dies, from the newest in-memory
    # snapshot (train.snapshot_every) or disk checkpoint; 0: a dead rank ends the task
    max_restarts: int = 0

    @property
    def procs(self) -> int:
        return self.procs_per_node or self.gpus_per_node


@dataclass(frozen=True)
class SweepFile:
    name: str  # the sweep's name: the job name, and its directory under run_root
    base: str  # the run config every point starts from (e.g. configs/demo.yaml)
    run_root: str = "runs/sweeps"  # each point runs in run_root/NAME/INDEX-POINT
    overrides: list[str] = field(default_factory=list)  # key=value overrides of every point
    grid: dict = field(default_factory=dict)  # {key: [values]}: their cartesian product
    points: list = field(default_factory=list)  # [{key: value}]: each one times the grid
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # the resources (below)


@dataclass
class Run:
    index: int
    overrides: list[str]
    config: Config

    @property
    def directory(self) -> Path:
        return Path(self.config.run.dir)


def expand(name: str, grid: dict, points: list) -> list[dict]:
    """The grid's cartesian product, times each point (either may be absent): {key: value}s."""
    empty = [k for k, values in grid.items() if not isinstance(values, list) or not values]
    if empty or (not grid and not points):
        raise ConfigError(f"sweep '{name}' has nothing to run: "
                          + (f"grid keys {empty} have no values" if empty else
                             "give a non-empty grid (key: [values]) or points"))
    product = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    return [{**g, **p} for g, p in itertools.product(product, points or [{}])]


def short_name(point: dict) -> str:
    """A point's settings as a directory name: a mapping's or a list's punctuation dropped; a
    section's kind by the section (model.attention.kind=mla: attentionmla)."""
    return "-".join(setting_name(k) + re.sub(r"[^\w.=+-]", "", str(v))
                    for k, v in point.items()) or "base"


def setting_name(key: str) -> str:
    """A setting's short name: its last part, or for a kind its section's."""
    return key.removesuffix(".kind").rsplit(".", 1)[-1]


def load_sweep(path: Path) -> tuple[SweepFile, list[Run]]:
    if not path.is_file():
        raise ConfigError(f"sweep file '{path}' not found")
    sweep = from_dict(SweepFile, yaml.safe_load(path.read_text()) or {}, "sweep.")
    spaced = [f"sweep.{k}={v!r}" for k, v in (("name", sweep.name), ("run_root", sweep.run_root),
                                               ("slurm.python", sweep.slurm.python)) if " " in v]
    if spaced:
        raise ConfigError(f"{', '.join(spaced)}: no spaces, please (#SBATCH lines cannot quote them)")
    if not Path(sweep.base).is_file():
        raise ConfigError(f"sweep.base '{sweep.base}' not found: name the run config the sweep "
                          f"varies (e.g. configs/demo.yaml)")
    # Absolute, so that the job finds its runs whatever directory sbatch is called from.
    sweep = dataclasses.replace(sweep, base=str(Path(sweep.base).resolve()),
                                run_root=str(Path(sweep.run_root).resolve()))
    if sweep.slurm.procs < 1:
        raise ConfigError("sweep.slurm: set gpus_per_node, or procs_per_node for CPU runs")
    world = sweep.slurm.nodes * sweep.slurm.procs
    runs = []
    for index, point in enumerate(expand(sweep.name, sweep.grid, sweep.points)):
        short = short_name(point)
        run_dir = Path(sweep.run_root) / sweep.name / f"{index}-{short}"
        overrides = sweep.overrides + [f"{k}={v}" for k, v in point.items()] + [f"run.dir={run_dir}"]
        try:
            # As the job will resolve it: under train.init_from the checkpoint's architecture,
            # written out whole in the point's config.yaml (plan.plan_config).
            config = plan_config(load_config(sweep.base, overrides, pretrained_model),
                                 given_keys(sweep.base, overrides), world)  # packages, data: the nodes'
        except ConfigError as err:
            raise ConfigError(f"sweep point {index} ({short}) on {sweep.slurm.nodes} node(s) x "
                              f"{sweep.slurm.procs} processes: {err}") from None
        runs.append(Run(index, overrides, config))
    return sweep, runs
