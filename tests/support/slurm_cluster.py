"""A real one-node Slurm cluster for the tests: munge, slurmctld and slurmd, as root, configured
for this host in a temporary directory, stopped by their pid files afterwards."""
import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from tests.support.nodes import free_port

CONF = """\
ClusterName=megalite-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only once the credentials of its last run have expired
# (120 s by default): short, so the preemption test does not wait minutes.
AuthInfo=cred_expire=5
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A requeued job, once eligible (cred_expire above), waits for the scheduler's next periodic
# pass over the queue: every second, not every 30 to 60 s (backfill's and the main loop's).
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def available() -> bool:
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("munged", "slurmctld", "slurmd", "sbatch"))


@contextmanager
def slurm_cluster(directory: Path):
    """Yields the environment (SLURM_CONF) under which sbatch, squeue and scontrol reach it."""
    directory = Path(directory)
    for sub in ("state", "spool"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    conf = directory / "slurm.conf"
    conf.write_text(CONF.format(host=socket.gethostname(), dir=directory, ctld_port=free_port(),
                                d_port=free_port(), cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    # Fails, harmlessly, when a munged is already running: then it is not ours to stop.
    started_munge = subprocess.run(["munged", "--force"], capture_output=True, timeout=60).returncode == 0
    subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, timeout=60)
    subprocess.run(["slurmd", "-f", str(conf)], env=env, check=True, timeout=60)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True,
                                   timeout=30)
            if state.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"slurm did not come up: {(directory / 'slurmctld.log').read_text()[-2000:]}")
        yield env
    finally:
        # A run writes its end before its job step has told the controller: stopped now, that
        # step's slurmstepd would stay behind, retrying a controller that is gone.
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            time.sleep(0.5)
        pid_files = [directory / "slurmd.pid", directory / "slurmctld.pid"]
        if started_munge:
            pid_files.append(Path("/run/munge/munged.pid"))
        for pid_file in pid_files:
            if pid_file.is_file():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except ProcessLookupError:
                    pass
