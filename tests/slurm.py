"""A real Slurm for the tests: Debian's slurm-wlm and munge (`make slurm` installs them), started in
a temporary directory the way tests/pg.py starts PostgreSQL: munged with its own key and socket,
slurmctld and one slurmd on 127.0.0.1, a generated slurm.conf that the clients find through
SLURM_CONF. Removed at exit.

No accounting database (slurmdbd): sacct cannot answer, so a finished job's record is read from
`scontrol show job` (MinJobAge keeps it in slurmctld for an hour); worker/agent/slurm_cli.py tries
sacct first and falls back the same way on a real cluster without accounting.

Two nodes on one host: two slurmd (`slurmd -N <name>`, each NodeName with its own Port, spool, log
and pid file), so a job of two nodes runs one node process on each, both on 127.0.0.1.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

NODES = ["tpnode1", "tpnode2"]
CPUS = 2  # per node, declared (config_overrides): a two-rank job fits one node on a 2-core machine


def installed() -> Optional[str]:
    """None when the binaries are there, else what is missing."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol")
               if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    return f"Slurm is not installed (missing {', '.join(missing)}; `make slurm`)" if missing else None


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="tokenpulse-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.host = socket.gethostname()

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        d = self.dir
        nodes = "\n".join(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={CPUS} "
                          "RealMemory=4000 State=UNKNOWN" for n in NODES)
        (d / "state").mkdir()
        (d / "spool").mkdir()
        self.conf.write_text(f"""\
ClusterName=tptest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=120
MessageTimeout=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
PlugStackConfig={d}/plugstack.conf
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        for n in NODES:
            (d / "spool" / n).mkdir()
        (d / "plugstack.conf").write_text("")

    def _start_munge(self) -> None:
        m = self.dir / "munge"
        m.mkdir(mode=0o700)
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn([_bin("munged"), "-F", "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
                     f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/seed"],
                    "munged")
        self._wait(lambda: (m / "munge.socket").exists(), "munged", 30)

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.dir / f"{name}.out", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, env=self.env,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def _wait(self, ok, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}): {self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} did not come up in {timeout:.0f} s: {self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        r = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr or r.stdout}")
        return r.stdout

    def start(self) -> "SlurmCluster":
        self._write_conf()
        atexit.register(self.stop)
        self._start_munge()
        self._spawn([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: subprocess.run(["scontrol", "ping"], capture_output=True, text=True,
                                          env=self.env).stdout.count("UP") > 0, "slurmctld", 60)
        for n in NODES:
            self._spawn([_bin("slurmd"), "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        self._wait(self.nodes_idle, "slurmd", 90)
        return self

    def nodes_idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env)
        return r.returncode == 0 and sum(s.strip().startswith(("idle", "mixed", "allocated"))
                                         for s in r.stdout.splitlines()) == len(NODES)

    def cancel_all(self, timeout: float = 30) -> None:
        """Every job of the cluster cancelled and gone from its nodes: stopping slurmd with steps still
        running would leave their slurmstepd and processes behind."""
        if not self.procs or any(p.poll() is not None for p in self.procs):
            return
        subprocess.run(["scancel", "--user", str(os.getuid())], capture_output=True, env=self.env, timeout=30)
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = subprocess.run(["squeue", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=30)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.3)

    def stop(self) -> None:
        try:
            self.cancel_all()
        except (OSError, subprocess.SubprocessError):
            pass
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
