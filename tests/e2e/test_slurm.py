"""SLURM preemption and requeue, on a one-node cluster started for the test.

Installs ``slurm-wlm`` and ``munge`` from Debian when missing, starts munged, slurmctld and
slurmd with a config in the test's temporary directory, submits the tiny config through
``python -m launch.submit`` (the rendered ``launch/slurm/train.sbatch``: srun + torchrun, 2
worker processes, ddp), sends SIGUSR1 to the job steps mid-run (what ``--signal=USR1@120``
does before the time limit), and checks that the job checkpointed, was requeued, resumed from
that checkpoint and finished. The daemons are stopped by PID. Skipped, with the reason, where
there is no root or no apt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import TINY, overrides

STEPS = 400
SBIN = Path("/usr/sbin")


def _run(cmd: list[str], env=None, timeout=60, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def _ensure_packages() -> None:
    if (
        all(shutil.which(tool) for tool in ("sbatch", "scontrol", "srun"))
        and (SBIN / "slurmctld").exists()
        and (SBIN / "munged").exists()
    ):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    if subprocess.run(install, capture_output=True, env=env, timeout=900).returncode:
        _run(["apt-get", "update", "-q"], env=env, timeout=600)
        _run(install, env=env, timeout=900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _munge_works() -> bool:
    if not shutil.which("munge"):
        return False
    cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    return (
        cred.returncode == 0
        and subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10).returncode == 0
    )


def _start_munge() -> int | None:
    """PID of the munged this test started, or None when one was already serving."""
    if _munge_works():
        return None
    run = Path("/run/munge")
    run.mkdir(parents=True, exist_ok=True)
    shutil.chown(run, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        _run(["runuser", "-u", "munge", "--", "/usr/sbin/mungekey", "--create"])
    _run(["runuser", "-u", "munge", "--", str(SBIN / "munged")])
    deadline = time.time() + 20
    while not _munge_works():
        if time.time() > deadline:
            raise RuntimeError("munged did not start")
        time.sleep(0.2)
    return int((run / "munged.pid").read_text())


def _slurm_conf(root: Path, host: str) -> Path:
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=fptest",
                f"SlurmctldHost={host}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                "AuthInfo=cred_expire=10",  # a requeued job waits this long before it may start again (default 120 s)
                "SchedulerParameters=sched_interval=2",  # and the scheduler looks at it this often (default 60 s)
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "JobAcctGatherType=jobacct_gather/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SlurmdParameters=config_overrides",  # the node is what this file says, whatever the machine has
                "KillWait=60",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    return conf


def _stop(pid: int | None, name: str) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cluster(tmp_path):
    """SLURM_CONF for a running one-node cluster; every daemon it started is stopped by PID."""
    _ensure_packages()
    if os.geteuid() != 0:
        pytest.skip("a private slurmd must run as root (it starts jobs as their user)")
    root = tmp_path / "slurm"
    host = socket.gethostname().split(".")[0]
    conf = _slurm_conf(root, host)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munged = _start_munge()
    daemons: list[subprocess.Popen] = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            log = open(root / f"{daemon}.stderr", "w")
            name = ["-N", host] if daemon == "slurmd" else []
            daemons.append(
                subprocess.Popen(
                    [str(SBIN / daemon), "-D", "-f", str(conf), *name], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
        deadline = time.time() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout.strip()
            if state == "idle":
                break
            if time.time() > deadline or any(d.poll() is not None for d in daemons):
                logs = "\n".join(
                    (root / f).read_text()[-1500:]
                    for f in ("slurmctld.stderr", "slurmd.stderr", "slurmctld.log", "slurmd.log")
                    if (root / f).exists()
                )
                raise RuntimeError(f"the SLURM node did not come up (state {state!r}):\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        for d in reversed(daemons):  # our children: wait() reaps them (a zombie still answers kill(pid, 0))
            d.terminate()
            try:
                d.wait(timeout=20)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait(timeout=30)
        _stop(munged, "munged")


def _job(job_id: str, env) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def test_preempted_job_is_requeued_and_finishes_from_its_checkpoint(cluster, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    args = overrides(
        run_dir,
        cache_dir,
        **{
            "train.engine": "ddp",
            "train.batch_size": 8,
            "train.micro_batch_size": 0,
            "train.max_steps": STEPS,
            "train.log_every": 1,
            "checkpoint.every": 0,
            "eval.every": 0,
            "eval.sample_tokens": 0,
        },
    )
    env = {**cluster, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    submit = [
        sys.executable,
        "-m",
        "launch.submit",
        "--config",
        str(TINY),
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--cpus-per-node",
        "2",
    ]
    for item in args[1::2]:
        submit += ["--set", item]
    proc = subprocess.run(submit, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    out_file = run_dir / f"slurm-{job_id}.out"

    def output() -> str:
        return out_file.read_text() if out_file.exists() else ""

    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert time.time() < deadline and _job(job_id, env).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), (
            output()[-4000:]
        )
        time.sleep(0.2)
    # what --signal=USR1@120 does before the time limit: the job steps (not the batch shell)
    _run(["scancel", "--signal=USR1", job_id], env=env)

    deadline = time.time() + 420
    while (state := _job(job_id, env).get("JobState")) != "COMPLETED":
        assert (
            state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") and time.time() < deadline
        ), f"job {state}:\n{output()[-6000:]}"
        time.sleep(1)
    info, text = _job(job_id, env), output()
    assert info.get("Restarts") == "1", (info, text[-4000:])
    preempted_at = int(re.search(r"preempted at step (\d+): requeueing", text).group(1))
    assert 5 <= preempted_at < STEPS, text[-4000:]
    assert "(restart 1)" in text, "the requeued job ran the script again"
    assert (
        f"resumed from {run_dir / 'checkpoints' / f'step_{preempted_at:08d}'}" in text
        or f"step_{preempted_at:08d}" in text.split("resumed from", 1)[1].splitlines()[0]
    ), text[-4000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if "loss" in json.loads(line)]
    assert steps == list(range(1, STEPS + 1)), "every step once: the second run continued where the checkpoint left off"
    assert (run_dir / "checkpoints" / f"step_{STEPS:08d}").is_dir()
    assert not (run_dir / "preempted").exists()
