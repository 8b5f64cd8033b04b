"""A job's whole process tree, as the agent sees it: where it is contained, how it is killed, and
the check that no process of an earlier attempt of the job still runs before the next starts.

Containment (keeper.py runs inside it): a cgroup v2 per attempt where the agent may make one (root,
a writable cgroup2 hierarchy; TOKENPULSE_JOB_CGROUPS=0 turns it off), else the keeper's subreaper
alone. Either way every process of the job carries TOKENPULSE_JOB_TREE=<tag> in its environment,
the tag naming the server, the job and the attempt, so a survivor is found even after its keeper
was killed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

from worker.agent.keeper import TAG_ENV
from worker.agent.proc import descendants

log = logging.getLogger("tokenpulse.agent")
KEEPER = str(Path(__file__).resolve().with_name("keeper.py"))
PREFIX = "tokenpulse-job"


@lru_cache(maxsize=1)
def cgroup_base() -> Optional[Path]:
    """The cgroup v2 directory the agent makes its jobs' cgroups in (its own cgroup), or None."""
    if os.environ.get("TOKENPULSE_JOB_CGROUPS", "1").lower() in ("0", "off", "false", "no"):
        return None
    if os.geteuid() != 0:
        return None
    try:
        mount = next(line.split(" - ")[0].split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                     if " - cgroup2 " in line)
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration, IndexError):
        return None
    base = Path(mount) / own.lstrip("/")
    probe = base / f"{PREFIX}-probe-p{os.getpid()}"
    try:
        probe.mkdir()
        ok = (probe / "cgroup.procs").exists()
        probe.rmdir()
    except OSError:
        return None
    return base if ok else None


def job_tag(server: str, job_id: int) -> str:
    """Names the job (and its server): `<job tag>#<attempt>` is what its processes carry."""
    return f"{job_id}@{hashlib.sha256(server.encode()).hexdigest()[:12]}"


def earlier(job: str, attempt: int, warm: Optional[dict[str, int]] = None) -> list[int]:
    """Live processes of this machine carrying the job's tag with another attempt than `attempt`
    (those this user may read), or the tag of a warm standby that ran another attempt of it (`warm`:
    its tag -> that attempt, from the job's record). The same attempt's other node ranks (a gang on
    one machine) stay."""
    needle = f"\0{TAG_ENV}=".encode()
    mine = f"{job}#"
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = b"\0" + (d / "environ").read_bytes()
        except OSError:
            continue
        at = env.find(needle)
        if at < 0:
            continue
        value = env[at + len(needle):env.find(b"\0", at + 1)].decode(errors="replace")
        ran = value[len(mine):] if value.startswith(mine) else (str(warm[value]) if warm and value in warm else None)
        if ran is not None and ran != str(attempt) and _alive(int(d.name)):
            found.append(int(d.name))
    return found


def read_warm_record(path: Optional[Path]) -> dict[str, int]:
    """A job's warm record: `<attempt> <standby tag>` per line, one per attempt started warm."""
    found: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines() if path is not None else []
    except OSError:
        return found
    for line in lines:
        attempt, _, tag = line.partition(" ")
        if attempt.isdigit() and tag:
            found[tag] = int(attempt)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def move_processes(src: Path, dst: Path) -> None:
    """Every process of cgroup src into dst (cgroup v2 renames no cgroup): a warm standby's keeper
    and training process, idle and forking nothing, into its attempt's."""
    for pid in cgroup_pids(src):
        try:
            (dst / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            pass
    if cgroup_pids(src):
        raise OSError(f"processes still in {src.name} after the move")


def kill_cgroup(path: Path) -> None:
    try:
        (path / "cgroup.kill").write_text("1")  # Linux 5.14+: every process in it, atomically
        return
    except OSError:
        pass
    kill_until_gone(lambda: cgroup_pids(path))


def kill_until_gone(live) -> None:
    """SIGKILL what `live()` lists until it lists nothing (a process may fork while we kill), 1 s at most."""
    for _ in range(100):
        pids = live()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def remove_cgroup(path: Path, wait_s: float = 10.0) -> None:
    end = time.monotonic() + wait_s
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # still populated: its last processes are being killed
            if time.monotonic() > end:
                log.warning("cgroup %s: still holds processes after %.0f s", path, wait_s)
                return
            time.sleep(0.05)


@dataclass
class JobTree:
    """One attempt's tree: its job's tag, and its cgroup while it runs."""
    job: str
    job_id: int
    attempt: int
    cgroup: Optional[Path] = None
    settled: list[int] = field(default_factory=list)  # survivors of earlier attempts killed at start
    # The job's warm record (warm.py): the standby tags its attempts started warm ran under.
    warm_record: Optional[Path] = None

    @property
    def tag(self) -> str:
        """What every process of the tree carries in TOKENPULSE_JOB_TREE."""
        return f"{self.job}#{self.attempt}"

    @property
    def cgroup_stem(self) -> str:
        """`tokenpulse-job<id>-s<server hash>`: job ids of two servers' agents on one machine collide."""
        return f"{PREFIX}{self.job.replace('@', '-s')}"

    @classmethod
    def for_job(cls, server: str, job_id: int, attempt: int) -> "JobTree":
        return cls(job_tag(server, job_id), job_id, attempt)

    def record_warm(self, standby_tag: str) -> None:
        """This attempt runs in a warm standby started under `standby_tag`: noted in the job's record
        before it runs, so a later attempt finds its survivors (their environment says the standby's tag)."""
        if self.warm_record is not None:
            with self.warm_record.open("a") as f:
                f.write(f"{self.attempt} {standby_tag}\n")

    def prepare_standby(self) -> None:
        """A warm standby's cgroup (before its keeper starts); its processes move to its attempt's on assignment."""
        base = cgroup_base()
        if base is not None:
            path = base / f"{self.cgroup_stem}-a{self.attempt}-p{os.getpid()}"
            try:
                path.mkdir(exist_ok=True)
                self.cgroup = path
            except OSError as e:
                log.warning("warm standby: no cgroup (%s); its keeper's subreaper holds its tree", e)

    def prepare(self, adopt: Optional[Path] = None) -> None:
        """Before the keeper starts (blocking: run it off the event loop): kill and wait out every
        process of an earlier attempt of this job still alive here, then make this attempt's cgroup
        (`adopt`: a warm standby's, whose processes move into it)."""
        base = cgroup_base()
        if base is not None:
            for old in base.glob(f"{self.cgroup_stem}-a*"):
                owner = old.name.rsplit("-p", 1)[-1]  # the agent pid that made it
                if owner.isdigit() and int(owner) != os.getpid() and _alive(int(owner)):
                    continue  # another live agent's: its own to end
                self.settled += [p for p in cgroup_pids(old) if _alive(p)]
                kill_cgroup(old)
                remove_cgroup(old)
        end = time.monotonic() + 30
        while True:
            left = earlier(self.job, self.attempt, read_warm_record(self.warm_record))
            if not left:
                break
            self.settled = sorted(set(self.settled) | set(left))
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if time.monotonic() > end:
                raise OSError(f"processes of an earlier attempt of job {self.job_id} survive SIGKILL "
                              f"(pids {', '.join(map(str, left))}): not starting beside them")
            time.sleep(0.05)
        if adopt is not None:
            self.cgroup = adopt
        if base is not None:
            path = base / f"{self.cgroup_stem}-a{self.attempt}-p{os.getpid()}"
            try:
                path.mkdir(exist_ok=True)
                if adopt is not None:
                    move_processes(adopt, path)
                self.cgroup = path
            except OSError as e:
                if adopt is not None:
                    remove_cgroup(path, wait_s=0)  # made, but the standby's processes stayed where they were
                log.warning("job %s: no cgroup of its own (%s); %s", self.job_id, e,
                            f"it stays in its standby's {adopt.name}" if adopt is not None
                            else "its keeper's subreaper holds its tree")
            if adopt is not None and self.cgroup == path:
                remove_cgroup(adopt, wait_s=1.0)

    def keeper_args(self, pid_fd: int, pass_fds: tuple[int, ...]) -> list[str]:
        import sys
        args = [sys.executable, "-I", KEEPER, "--agent-pid", str(os.getpid()), "--pid-fd", str(pid_fd),
                "--tag", self.tag]
        if self.cgroup is not None:
            args += ["--cgroup", str(self.cgroup)]
        for fd in pass_fds:
            args += ["--pass-fd", str(fd)]
        return args

    def kill(self, keeper_pid: Optional[int]) -> None:
        """SIGKILL every process of the attempt but the keeper (which then ends as its job process
        did); with a cgroup, the keeper too."""
        if self.cgroup is not None:
            kill_cgroup(self.cgroup)
            return
        if keeper_pid is None:
            return
        kill_until_gone(lambda: [p for p in descendants(keeper_pid) if _alive(p)])

    def release(self) -> None:
        """After the keeper exited: the attempt's cgroup goes (it is empty by then)."""
        if self.cgroup is not None:
            remove_cgroup(self.cgroup, wait_s=5.0)
            self.cgroup = None


def sweep() -> None:
    """At agent start: cgroups of agents that died (kill -9, with their keepers) are emptied and removed."""
    base = cgroup_base()
    if base is None:
        return
    for old in base.glob(f"{PREFIX}*-a*-p*"):
        pid = old.name.rsplit("-p", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            left = [p for p in cgroup_pids(old) if _alive(p)]
            if left:
                log.warning("killed %d processes left in %s by agent pid %s, which died (pids %s)",
                            len(left), old.name, pid, left[:20])
            kill_cgroup(old)
            remove_cgroup(old, wait_s=2.0)
