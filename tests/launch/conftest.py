"""Fixtures of the launcher tests: the small-run overrides, and a real one-node SLURM cluster.

The cluster runs on this machine from a private folder: its own munge key and socket, slurm.conf,
state, spool, pid and log files, and free ports, so it touches nothing of the system's. It needs
root; Debian's packages are installed when missing. The daemons bind their ports themselves, after
tests/ports.py found them free: where another process took one in between, they start again on
fresh ports.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ports import unclaimed_ports
from train_helpers import SMALL

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
SYSTEM_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])
PORT_TAKEN = "Address already in use"  # what a daemon logs when its port is taken (EADDRINUSE)
PORT_ATTEMPTS = 3


def _which(program):
    return shutil.which(program, path=SYSTEM_PATH)


def _install_slurm():
    missing = [p for p in SLURM_PROGRAMS if _which(p) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing) and installing it "
                    f"needs root: apt-get install {' '.join(SLURM_PACKAGES)}")
    if _which("apt-get") is None:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing) and there is no "
                    f"apt-get to install {' '.join(SLURM_PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", *SLURM_PACKAGES]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    still = [p for p in SLURM_PROGRAMS if _which(p) is None]
    assert not still, f"after installing {SLURM_PACKAGES}, still missing: {still}"


class SlurmCluster:
    """slurmctld + slurmd + munged for this host only; jobs run as root on all its CPUs."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        # Jobs' temporary files (train.sbatch's pid files among them) stay in this folder.
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=SYSTEM_PATH,
                        TMPDIR=str(root / "tmp"))
        self.jobs = []  # every job id submitted through this object, cancelled at the end

    def start(self):
        r = self.root
        for sub in ("state", "spool", "log", "tmp"):
            (r / sub).mkdir()
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: munged refuses key and socket folders it considers insecure, such as under /tmp
        self._run_daemon([_which("munged"), "--force", f"--socket={r / 'munge.sock'}",
                          f"--key-file={key}", f"--pid-file={r / 'munged.pid'}",
                          f"--log-file={r / 'log/munged.log'}", f"--seed-file={r / 'munged.seed'}"])
        self._wait_for(lambda: (r / "munge.sock").exists(), "munged's socket")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.conf.write_text(self._slurm_conf(*unclaimed_ports(2)))
            started = [self._run_daemon([_which("slurmctld")], PORT_TAKEN),
                       self._run_daemon([_which("slurmd"), "-N", self.host], PORT_TAKEN)]
            if all(started):
                self._wait_for(lambda: self._port_taken() or self._node_idle(), "the node to become idle in sinfo")
                if not self._port_taken():
                    return
            # a port was taken after it was found free: stop what started, and again on fresh ports
            _stop_by_pid_files([r / "slurmd.pid", r / "slurmctld.pid"])
            for log in (r / "log").glob("slurm*.log"):
                log.rename(log.with_name(f"{log.name}.ports-taken-{attempt}"))
        raise AssertionError(f"the SLURM daemons' ports were taken {PORT_ATTEMPTS} times in a row\n{self.logs()}")

    def _port_taken(self):
        return any(PORT_TAKEN in log.read_text(errors="replace") for log in (self.root / "log").glob("slurm*.log"))

    def _slurm_conf(self, controller_port, node_port):
        r = self.root
        # cred_expire sets how long a requeued job waits before it may start again (+1 s).
        return f"""\
ClusterName=dmoetest
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / 'munge.sock'},cred_expire=10
SlurmctldPort={controller_port}
SlurmdPort={node_port}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log/slurmctld.log'}
SlurmdLogFile={r / 'log/slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""

    def _run_daemon(self, command, unless=None):
        """Start a daemon; False where it failed saying `unless` (else a failure fails the test)."""
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=self.env)
        if proc.returncode and unless is not None and unless in proc.stdout + proc.stderr:
            return False
        assert proc.returncode == 0, f"{command[0]} did not start:\n{proc.stderr}\n{self.logs()}"
        return True

    def _node_idle(self):
        proc = self.run("sinfo", "-h", "-o", "%T", check=False)
        return proc.stdout.strip() == "idle"

    def _wait_for(self, condition, what, timeout=60):
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.logs()}")
            time.sleep(0.3)

    def run(self, *command, check=True, env=None):
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=60,
                              env=env or self.env)
        if check:
            assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr}\n{self.logs()}"
        return proc

    def sbatch(self, *args, env=None, cwd=None):
        proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                              timeout=60, env={**self.env, **(env or {})}, cwd=cwd)
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}\n{self.logs()}"
        job = proc.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job_info(self, job):
        return self.run("scontrol", "show", "job", job).stdout

    def wait_until_gone(self, job, timeout=400, output=()):
        """Wait until the job (all its array tasks, requeues included) has left the queue."""
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-j", job, check=False).stdout.strip():
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} still queued after {timeout} s\n"
                                     f"{self.job_info(job)}\n{self.logs(output)}")
            time.sleep(0.5)

    def logs(self, extra=()):
        """The tails of the daemons' logs and of the given job output files, for failure messages."""
        parts = []
        for path in [*(self.root / "log").glob("*.log"), *map(Path, extra)]:
            if path.is_file():
                parts.append(f"--- {path}:\n" + "\n".join(path.read_text(errors="replace")
                                                          .splitlines()[-60:]))
        return "\n".join(parts)

    def stop(self):
        if self.jobs and self.conf.exists():
            self.run("scancel", *self.jobs, check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run(
                    "squeue", "-h", "-j", ",".join(self.jobs), check=False).stdout.strip():
                time.sleep(0.5)
        _stop_by_pid_files([self.root / f"{name}.pid" for name in ("slurmd", "slurmctld", "munged")])


def _stop_by_pid_files(paths):
    """SIGTERM to each daemon named by a pid file, SIGKILL to those still there after 15 s."""
    pids = []
    for path in paths:
        try:
            pid = int(path.read_text().strip())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            continue
        pids.append(pid)
    deadline = time.monotonic() + 15
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def slurm_cluster():
    _install_slurm()
    if os.geteuid() != 0:
        pytest.skip("the test SLURM cluster runs its daemons and jobs as root")
    root = Path(tempfile.mkdtemp(prefix="dmoe-slurm-", dir="/tmp"))  # short: socket paths
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def small_run(corpus_cache):
    """small_run(train_iters, *extra): overrides for a quick CPU run of the tiny config."""
    def overrides(train_iters, *extra):
        return SMALL + [f"training.train_iters={train_iters}", "training.eval_interval=0",
                        f"data.cache_dir={corpus_cache}", *extra]
    return overrides


@pytest.fixture
def job_env():
    """Environment for training jobs: this interpreter, one CPU process per node."""
    return {"PYTHON": sys.executable, "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}
