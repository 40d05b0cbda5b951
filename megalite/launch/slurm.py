"""`megalite slurm SWEEP.yaml [--dry-run | --submit]` and `megalite sweep-status DIR`.

--submit writes each point's resolved config to RUN_ROOT/<sweep>/<index>-<short>/config.yaml,
their list to RUN_ROOT/<sweep>/configs.txt, and ONE sbatch script, RUN_ROOT/<sweep>/sweep.sbatch,
whose array task i trains config i (megalite/launch/sbatch.template), then submits it; --dry-run prints
the script and the runs and writes nothing.
"""
import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from string import Template

import yaml

from megalite.command_args import slurm_parser, sweep_status_parser
from megalite.launch.sweep import Run, SweepFile, load_sweep
from megalite.run_config import to_dict
from megalite.training.checkpoint_dirs import latest_checkpoint
from megalite.training.metrics import read_records
from megalite.typed_config import ConfigError

TEMPLATE = Path(__file__).resolve().parent / "sbatch.template"  # package data


def render(sweep: SweepFile, runs: list[Run], sweep_file: Path, sweep_dir: Path) -> str:
    s = sweep.slurm
    optional = [f"#SBATCH --{key.replace('_', '-')}={getattr(s, key)}"
                for key in ("partition", "account", "qos", "constraint", "gpus_per_node") if getattr(s, key)]
    optional += [f"#SBATCH {line}" for line in s.extra_sbatch]
    # The template's other names are SlurmConfig's fields.
    return Template(TEMPLATE.read_text()).substitute(
        dataclasses.asdict(s), name=sweep.name, count=len(runs), last=len(runs) - 1, sweep_file=sweep_file,
        throttle=f"%{s.throttle}" if s.throttle else "", sweep_dir=sweep_dir.resolve(),
        optional_sbatch="\n".join(optional), setup="\n".join(s.setup), procs_per_node=s.procs,
        workdir=Path.cwd())


def write_sweep(sweep: SweepFile, runs: list[Run], script: str) -> Path:
    """Each point's config.yaml, their list and the sbatch script; the script's path."""
    sweep_dir = Path(sweep.run_root) / sweep.name
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    for run in runs:
        run.directory.mkdir(parents=True, exist_ok=True)
        (run.directory / "config.yaml").write_text(yaml.safe_dump(to_dict(run.config), sort_keys=False))
    (sweep_dir / "configs.txt").write_text(
        "".join(f"{(run.directory / 'config.yaml').resolve()}\n" for run in runs))
    (sweep_dir / "sweep.sbatch").write_text(script)
    return sweep_dir / "sweep.sbatch"


def table(runs: list[Run]) -> str:
    rows = [("index", "run dir", "overrides")] + [
        (str(r.index), str(r.directory), " ".join(o for o in r.overrides if not o.startswith("run.dir=")))
        for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def main(argv: list[str]) -> int:
    args = slurm_parser().parse_args(argv)
    sweep, runs = load_sweep(Path(args.sweep))
    sweep_dir = Path(sweep.run_root) / sweep.name
    text = render(sweep, runs, Path(args.sweep), sweep_dir)
    if args.dry_run:
        print(f"{text}\n{table(runs)}\n\nnothing written: --submit writes the script and each run's "
              f"config.yaml under {sweep_dir} and submits it")
        return 0
    script = write_sweep(sweep, runs, text)
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found: run on a Slurm login node, or use --dry-run")
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {done.stderr.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    (sweep_dir / "job_id").write_text(job_id + "\n")
    print(f"submitted job {job_id}: {len(runs)} array tasks; megalite sweep-status {sweep_dir}")
    return 0


def task_states(sweep_dir: Path) -> dict[int, str] | None:
    """Slurm's view of each array task, from sacct, else squeue; None when the sweep was not
    submitted or Slurm did not answer (then a task's absence means nothing)."""
    job_file = sweep_dir / "job_id"
    if not job_file.is_file():
        return None
    job = job_file.read_text().strip()
    if shutil.which("sacct"):
        out = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "--format=JobID,State"],
                             capture_output=True, text=True)
        if out.returncode == 0 and (states := array_tasks(out.stdout)):
            return states
    if not shutil.which("squeue"):
        return None
    out = subprocess.run(["squeue", "-j", job, "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True)
    if out.returncode != 0:
        # A finished job is "invalid" to squeue once slurmctld forgets it: the queue answered.
        return {} if "Invalid job id" in out.stderr else None
    return array_tasks(out.stdout)


def array_tasks(listing: str) -> dict[int, str]:
    """{task: state} from sacct's or squeue's JOBID|STATE lines ("CANCELLED by 42": CANCELLED);
    the job's own line (no _TASK) is left out."""
    states = {}
    for line in listing.splitlines():
        job_id, state = line.split("|")[:2]
        task = job_id.partition("_")[2]
        if task.isdigit():
            states[int(task)] = state.split()[0]
    return states


# COMPLETED: Slurm says so, the run did not (a finished run is done by its last checkpoint).
SLURM_STATES = {"OUT_OF_MEMORY": "OOM", "TIMEOUT": "timeout", "FAILED": "failed",
                "CANCELLED": "failed", "NODE_FAIL": "failed", "PENDING": "pending",
                "RUNNING": "running", "REQUEUED": "pending", "COMPLETED": "failed"}


def run_status(run_dir: Path, slurm_state: str | None, queue_answered: bool) -> dict:
    """slurm_state: Slurm's state of the task, None when it does not list it; queue_answered:
    whether Slurm was asked about a submitted sweep and answered."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    latest = latest_checkpoint(run_dir)
    if latest is not None and latest.name == f"step_{config['train']['max_steps']:08d}":
        state = "done"  # finished
    elif slurm_state is not None:
        state = SLURM_STATES.get(slurm_state, slurm_state.lower())
    elif queue_answered:
        state = "failed"  # left the queue (without accounting: gone from squeue) unfinished
    elif (run_dir.parent / "job_id").is_file():
        state = "unknown"  # Slurm did not answer
    else:
        state = "not submitted"
    last = next((r for r in reversed(read_records(run_dir / "metrics.jsonl")) if "loss" in r), {})
    return {"state": state, **{key: last.get(key) for key in ("step", "loss", "tokens_per_s")}}


def main_status(argv: list[str]) -> int:
    args = sweep_status_parser().parse_args(argv)
    sweep_dir = Path(args.sweep_dir)
    if not (sweep_dir / "configs.txt").is_file():
        raise ConfigError(f"'{sweep_dir}' is not a sweep directory (no configs.txt)")
    slurm = task_states(sweep_dir)
    runs = [Path(line).parent for line in (sweep_dir / "configs.txt").read_text().splitlines()]
    rows = [{"index": i, "run": run.name, **run_status(run, (slurm or {}).get(i), slurm is not None)}
            for i, run in enumerate(runs)]
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "-"
        print(f"{r['index']:>4}  {r['run']:<40} {r['state']:<8} step {r['step'] or '-':>6}  "
              f"loss {loss:>8}  tok/s {tps:>10}")
    return 0
