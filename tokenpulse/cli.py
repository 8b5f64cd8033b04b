"""`tokenpulse`: start the server (with an embedded agent), run an agent, submit and watch jobs."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from tokenpulse import cli_runs
from tokenpulse.cli_runs import add_project_options
from tokenpulse.client import DEFAULT_URL, ApiError, Client

FINAL = {"completed", "failed", "cancelled", "paused"}


def _console():
    from rich.console import Console
    return Console()


# ---- server and agent --------------------------------------------------------------------------

def cmd_up(args) -> int:
    """Server on 127.0.0.1 with an embedded agent process: the one-command start."""
    os.environ["TOKENPULSE_DATA_DIR"] = str(args.data_dir)
    from server.settings import Settings
    settings = Settings(data_dir=args.data_dir, host=args.host, port=args.port)
    return serve(settings, embedded_agents=0 if args.no_worker else args.workers, demo=args.demo)


def serve(settings, embedded_agents: int = 0, demo: bool = False) -> int:
    import uvicorn

    from server.app import create_app, tune_serving_process

    url = f"http://{settings.host}:{settings.port}"
    app = create_app(settings)
    tune_serving_process()
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level="warning", ws_max_size=1 << 20,
                            # Frames are serialized once for all subscribers; per-message deflate
                            # would compress each one again per socket (most of the fan-out CPU).
                            ws_per_message_deflate=False)
    server = uvicorn.Server(config)
    agents: list[subprocess.Popen] = []
    console = _console()

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                return task.result()
            await asyncio.sleep(0.05)
        token = (settings.data_dir / "token").read_text().strip()
        console.print(f"[bold green]tokenpulse[/] is up at [link={url}]{url}[/]")
        console.print(f"admin token: [bold]{token}[/]  (also in {settings.data_dir / 'token'}; "
                      "`tokenpulse tokens create NAME --role user` makes tokens for others)")
        for i in range(embedded_agents):
            # On one machine the embedded worker runs as the user who started it: its token (made at
            # first start) takes command and multi-node jobs, which only admins and users with the
            # commands scope submit.
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "tokenpulse.cli", "agent", "--server", url,
                 "--token-file", str(settings.data_dir / "agent_token"),
                 "--work-dir", str(settings.data_dir / f"agent-{i}"), "--allow-commands"],
                preexec_fn=_stop_with_parent if sys.platform.startswith("linux") else None))
        if embedded_agents:
            console.print(f"{embedded_agents} embedded worker(s) started; Ctrl-C stops everything")
            stop_family_on_signals(server, agents, console)
        if demo:
            job = Client(url, token).submit({"name": "demo"})
            console.print(f"demo job submitted: {url}/jobs/{job['id']}")
        await task

    try:
        try:  # uvloop (uvicorn[standard] brings it): its C transports cut the CPU of each request
            import uvloop
            run = uvloop.run
        except ImportError:
            run = asyncio.run
        run(main())
    except KeyboardInterrupt:
        pass
    finally:  # the server ended some other way (an error): its agents must not outlive it
        for p in agents:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        wait_all(agents, 30)
    return 0


def _stop_with_parent() -> None:
    """In an embedded agent, before exec: when `tokenpulse up` dies (kill -9 included) the kernel
    sends the agent SIGTERM, so it stops (checkpointing its jobs) instead of living on to join
    whatever server starts next on the port."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_family_on_signals(server, agents: list[subprocess.Popen], console) -> None:
    """SIGTERM/SIGINT stop the whole family, agents first: each checkpoints its jobs and reports them
    requeued while the server still listens; then the server stops. (uvicorn's own handlers would
    stop the server at once and re-raise SIGTERM, killing this process before it stops its agents:
    they lived on, and joined whatever server started next on the port.) A second signal kills the
    agents (their training processes die with them) and stops the server at once."""
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    async def stop_agents_then_server() -> None:
        for p in agents:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        # an agent gives each job up to 60 s to checkpoint, then up to 30 s to send what is left
        await asyncio.to_thread(wait_all, agents, 120)
        server.should_exit = True

    def on_signal(signum, frame) -> None:
        if not stopping:
            console.print(f"{signal.Signals(signum).name}: stopping the workers (their jobs checkpoint and "
                          "requeue), then the server; again to stop at once")
            stopping.append(loop.create_task(stop_agents_then_server()))
        else:
            for p in agents:
                if p.poll() is None:
                    p.kill()
            server.should_exit = server.force_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: loop.call_soon_threadsafe(on_signal, signum, frame))


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process, up to timeout in all; SIGKILL whatever is left."""
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def cmd_server(args) -> int:
    from server.settings import Settings
    overrides = {k: v for k, v in {"data_dir": args.data_dir, "host": args.host, "port": args.port}.items()
                 if v is not None}
    return serve(Settings(**overrides))


def cmd_db(args) -> int:
    """`tokenpulse db backup OUT`: an online backup of the store (the server may keep running)."""
    from server.backup import BackupError, backup
    from server.settings import Settings
    settings = Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    try:
        _console().print(backup(settings.db_url, Path(args.out)))
    except BackupError as e:
        _console().print(f"[red]backup failed[/]: {e}")
        return 1
    return 0


def cmd_agent(args) -> int:
    from worker.agent import Agent
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the useful ones
    token = args.token or os.environ.get("TOKENPULSE_AGENT_TOKEN") or (
        Path(args.token_file).read_text().strip() if args.token_file else None)
    if not token:
        raise SystemExit("an agent needs --token, --token-file or TOKENPULSE_AGENT_TOKEN (an agent token)")
    if args.slurm:
        return slurm_executor(args, token)
    agent = Agent(args.server, token, Path(args.work_dir).resolve(), name=args.name, capacity=args.capacity or 1,
                  heartbeat_s=args.heartbeat, grace_s=args.grace,
                  resume_roots=[Path(p) for p in args.resume_root] if args.resume_root else None,
                  allow_commands=args.allow_commands, address=args.address, warm_start=not args.no_warm_start)

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(agent.stop()))
        await agent.run(max_jobs=args.max_jobs, until_idle=args.burst)
    asyncio.run(main())
    return 0


def slurm_executor(args, token: str) -> int:
    """`tokenpulse agent --slurm`: jobs claimed here run as Slurm batch jobs (worker/agent/slurm_executor.py)."""
    from worker.agent.slurm_executor import SlurmExecutor
    if shutil.which("sbatch") is None:
        raise SystemExit("--slurm needs Slurm's sbatch on the PATH (run the executor on a login node)")
    executor = SlurmExecutor(args.server, token, Path(args.work_dir), name=args.name,
                             capacity=args.capacity or 8, partition=args.partition,
                             account=args.account, sbatch_args=args.sbatch_arg or [],
                             allow_commands=args.allow_commands, heartbeat_s=args.heartbeat)

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(executor.stop()))
        await executor.run()
    asyncio.run(main())
    return 0


# ---- jobs ------------------------------------------------------------------------------------------

def load_spec(path: str) -> dict:
    import yaml
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    spec = yaml.safe_load(text) or {}
    if not isinstance(spec, dict):
        raise SystemExit(f"{path}: a job spec is a mapping of settings (see README)")
    return spec


def with_project(spec: dict, args) -> None:
    """--project and --tag on a submit: they win over the spec's own."""
    if args.project:
        spec["project"] = args.project
    if args.tag:
        spec["tags"] = list(dict.fromkeys([*spec.get("tags", []), *args.tag]))


def client(args) -> Client:
    return Client(args.url)


def report_error(e: ApiError) -> int:
    console = _console()
    d = e.detail
    if isinstance(d, dict) and d.get("errors"):
        for err in d["errors"]:
            console.print(f"[red]error[/] {err['field']}: {err['message']}")
    else:
        console.print(f"[red]error[/] {e}")
    return 2


def cmd_submit(args) -> int:
    spec = load_spec(args.spec)
    for kv in args.set or []:
        key, _, value = kv.partition("=")
        import yaml
        spec[key] = yaml.safe_load(value)
    if args.test:
        spec["test_run"] = True
    with_project(spec, args)
    try:
        job = client(args).submit(spec)
    except ApiError as e:
        return report_error(e)
    console = _console()
    console.print(f"job [bold]{job['id']}[/] ({job['name']}) queued: {client(args).url}/jobs/{job['id']}")
    print_warnings(console, job)
    return watch(client(args), job["id"]) if args.follow else 0


def print_warnings(console, job: dict) -> None:
    """The submit's preflight advice: each warning with its field and fix (the job runs as asked)."""
    for w in job.get("warnings") or []:
        console.print(f"[yellow]warning[/] {w['field']}: {w['message']}", highlight=False)
        console.print(f"  fix: {w['fix']}", highlight=False)
    if (job.get("preflight") or {}).get("analysis") == "pending":
        console.print("the data analysis behind the warnings is still running; `tokenpulse analyze` shows it in full")


def cmd_demo(args) -> int:
    try:
        job = client(args).submit({"name": "demo", **({"max_steps": args.steps} if args.steps is not None else {})})
    except ApiError as e:
        return report_error(e)
    _console().print(f"demo job [bold]{job['id']}[/] queued: {client(args).url}/jobs/{job['id']}")
    return watch(client(args), job["id"]) if not args.no_follow else 0


def watch(c: Client, job_id: int) -> int:
    """Follow a job in the terminal with a rich progress bar until it ends. Ctrl+C stops watching,
    never the job (it runs on a worker), and says how to cancel it."""
    try:
        return _watch(c, job_id)
    except KeyboardInterrupt:
        _console().print(f"\nstopped watching; job {job_id} keeps running on its worker. "
                         f"Cancel it with: [bold]tokenpulse cancel {job_id}[/]  (watch again: tokenpulse watch "
                         f"{job_id})",
                         soft_wrap=True)  # one line: a command to copy must not break in two
        return 130


def _watch(c: Client, job_id: int) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tokenpulse.progress import RateEstimator, format_duration
    console = _console()
    rate = RateEstimator()
    with Progress(TextColumn("[bold]{task.fields[state]}[/]"), TextColumn("{task.description}"),
                  BarColumn(), TextColumn("{task.fields[extra]}"), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("", total=None, state="queued", extra="")
        while True:
            job = c.job(job_id)
            phase = job.get("phase") or {}
            last = job.get("last") or {}
            extra = []
            if "loss" in last:
                extra.append(f"loss {num(last['loss'], '.4f')}")
            if "tokens_per_s" in last:
                extra.append(f"{num(last['tokens_per_s'], ',.0f')} tok/s")
            if job["state"] in ("running", "starting") and phase.get("total"):
                rate.update(phase.get("name", ""), time.time(), phase.get("done") or 0)
                eta = rate.eta_s(phase.get("done") or 0, phase["total"])
                extra.append(f"ETA {format_duration(eta)}" if eta is not None else "ETA measuring…")
            if job.get("alive_at") and job["state"] in ("running", "starting"):
                extra.append(f"heartbeat {time.time() - job['alive_at']:.0f} s ago")
            over = job["state"] == "completed"
            progress.update(task, description=phase_label(job), total=1 if over else phase.get("total"),
                            completed=1 if over else phase.get("done") or 0, state=job["state"],
                            extra="  ".join(extra))
            if job["state"] in FINAL:
                break
            time.sleep(1)
    color = {"completed": "green", "failed": "red"}.get(job["state"], "yellow")
    console.print(f"job {job_id} [{color}]{job['state']}[/]" + (f": {job['reason']}" if job.get("reason") else ""))
    line = final_eval(job)
    if line:
        console.print(line)
    if job.get("output_dir"):
        console.print(f"model saved in {job['output_dir']}")
    return 0 if job["state"] == "completed" else 1


def num(v, spec: str) -> str:
    """A latest value in the given format; a non-finite one as the server keeps it ("nan" -> NaN, "inf")."""
    return ("NaN" if v == "nan" else v) if isinstance(v, str) else format(v, spec)


def final_eval(job: dict) -> str:
    """'eval loss 2.31, perplexity 10.1 (step 200)' from the job's latest values, or ''."""
    last = job.get("last") or {}
    if "eval/loss" not in last:
        return ""
    ppl = f", perplexity {num(last['eval/ppl'], '.4g')}" if "eval/ppl" in last else ""
    return f"eval loss {num(last['eval/loss'], '.4f')}{ppl}"


def parse_env(pairs: Optional[list[str]]) -> dict[str, str]:
    env = {}
    for kv in pairs or []:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env {kv!r}: give NAME=VALUE")
        env[key] = value
    return env


def cmd_run(args) -> int:
    """Run a command (your own training script) as a job on an agent."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("nothing to run: tokenpulse run [options] -- python train.py ...")
    spec = {"command": command, "cwd": str(Path(args.cwd).resolve()) if args.cwd else os.getcwd(),
            "env": parse_env(args.env), "secret_env": args.secret_env or [], "instrument": not args.no_instrument}
    for key in ("name", "priority", "max_retries"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    with_project(spec, args)
    c = client(args)
    try:
        job = c.run(**spec)
    except ApiError as e:
        return report_error(e)
    console = _console()
    console.print(f"job [bold]{job['id']}[/] ({job['name']}) queued: {c.url}/jobs/{job['id']}")
    if job.get("reason"):
        console.print(f"[yellow]note[/] {job['reason']}")
    return watch(c, job["id"]) if args.follow else 0


def cmd_watch(args) -> int:
    return watch(client(args), args.job)


def phase_label(job: dict) -> str:
    """What a job is doing, or, once it stopped, where: a finished job's last phase ("saving") is
    not what it does now."""
    phase, state = job.get("phase") or {}, job["state"]
    name = phase.get("name")
    if state == "queued":
        return "waiting for a worker"
    if state == "completed":
        return "done"
    if state in ("failed", "cancelled", "paused"):
        return f"stopped in {name}" if name else ""
    if not name:
        return "running"
    if phase.get("total"):
        return f"{name} {phase.get('done', 0):,.0f}/{phase['total']:,.0f} {phase.get('unit') or ''}".rstrip()
    return name


def cmd_jobs(args) -> int:
    from rich.table import Table
    data = client(args).jobs(state=args.state, q=args.q, limit=args.limit, project=args.project, tags=args.tag)
    table = Table("id", "name", "project", "tags", "state", "phase", "step", "loss", "eval loss", "tok/s",
                  title=f"{data['total']} jobs")
    for j in data["jobs"]:
        last = j.get("last") or {}
        table.add_row(str(j["id"]), j["name"], j.get("project", ""), " ".join(j.get("tags") or []), j["state"],
                      phase_label(j),
                      f"{j.get('step') or 0}/{j.get('total_steps') or '?'}",
                      f"{num(last['loss'], '.4f')}" if "loss" in last else "",
                      f"{num(last['eval/loss'], '.4f')}" if "eval/loss" in last else "",
                      f"{num(last['tokens_per_s'], ',.0f')}" if "tokens_per_s" in last else "")
    _console().print(table)
    return 0


def _anatomy(c: Client, job_id: int) -> dict:
    """Each rank's newest step anatomy ({rank: {part: s}}), from the job's anatomy/ metrics."""
    from tokenpulse import anatomy_view
    r = c.request("GET", f"/api/jobs/{job_id}/metrics", params={"prefix": anatomy_view.PREFIX, "max_points": 2})
    return anatomy_view.latest(r.get("series") or {})


def cmd_show(args) -> int:
    """The job's record as JSON, with each rank's step anatomy (the share of a step waiting for data,
    computing, in collectives), the verdicts still open (slow reasons, stragglers, stalls) and where
    each captured metric came from (metric_sources)."""
    from tokenpulse import anatomy_view
    c = client(args)
    try:
        job = c.job(args.job)
        job["step_anatomy"] = {str(r): anatomy_view.shares(p) for r, p in _anatomy(c, args.job).items()}
        job["verdicts"] = [a["message"] for a in c.alerts(job_id=args.job, limit=100) if a["state"] != "cleared"]
        # where each metric read from the script came from: {"loss": "logger: wandb.log", "val_loss": "printed"}
        info = job.get("info") or {}
        via = info.get("metric_via") or {}
        job["metric_sources"] = {k: f"{v}: {via[k]}" if k in via else v
                                 for k, v in (info.get("metric_sources") or {}).items()}
    except ApiError as e:
        return report_error(e)
    if args.attempts:
        _console().print(attempts_table(job))
    else:
        print(json.dumps(job, indent=2))
    return 0


def attempts_table(job: dict):
    """Each attempt of a job: how it ended, the failure's class, the change made for the next one and
    why the next was (not) made (the retry policy's account, or a fix's relaunch)."""
    from rich.table import Table
    table = Table("#", "agent", "outcome", "class", "change", "decision", title=f"job {job['id']}: attempts",
                  show_lines=True)

    def change(ch) -> str:
        return ", ".join(f"{k} {v[0]} -> {v[1]}" if isinstance(v, list) and len(v) == 2 else f"{k} {v}"
                         for k, v in (ch or {}).items()) or "-"
    for a in job["attempts"]:
        outcome = a["outcome"] or ("running" if a["ended_at"] is None else "ended")
        table.add_row(str(a["attempt"]), str(a["agent_id"] or "-"), outcome, a["failure_class"] or "-",
                      change(a["change"]), a["decision"] or "-")
    return table


def cmd_logs(args) -> int:
    """A job's log (or the lines matching --grep), and with --follow the new lines until it ends."""
    import time as _time
    c = client(args)
    after, first = -1, True
    try:
        while True:
            r = c.logs(args.job, grep=args.grep, regex=args.regex, after_seq=after,
                       limit=args.tail if first and args.tail else 100_000)
            for line in r["lines"]:
                print(f"{line['stream']}: {line['line']}" if args.streams else line["line"], flush=True)
            after, first = r["last_seq"], False
            if not args.follow:
                return 0
            if c.job(args.job)["state"] in ("completed", "failed", "cancelled", "paused"):
                r = c.logs(args.job, grep=args.grep, regex=args.regex, after_seq=after, limit=100_000)
                for line in r["lines"]:
                    print(f"{line['stream']}: {line['line']}" if args.streams else line["line"], flush=True)
                return 0
            _time.sleep(1.0)
    except ApiError as e:
        return report_error(e)


def cmd_mcp(args) -> int:
    """Serve the Model Context Protocol over stdio (tokenpulse/mcp_server.py), with the caller's token."""
    from tokenpulse.mcp_server import serve
    serve(Client(args.url))
    return 0


def cmd_ranks(args) -> int:
    """A distributed job's ranks: host, pid, device, step, step time, own work, memory, last progress,
    and once the attempt is over how each rank ended."""
    from rich.table import Table
    c = client(args)
    try:
        rows = c.ranks(args.job)
        parts = _anatomy(c, args.job) if rows else {}
    except ApiError as e:
        return report_error(e)
    if not rows:
        _console().print(f"job {args.job} has no ranks (one process, or not started)")
        return 0
    table = Table("rank", "host", "pid", "device", "step", "step time", "busy", "data", "compute", "comm",
                  "memory", "last progress", "exit", title=f"job {args.job}: {len(rows)} ranks")
    s = (lambda v: "" if v is None else f"{v:.3g} s")
    for r in rows:
        a = parts.get(r["rank"], {})  # seconds per step waiting for data, computing, in collectives
        table.add_row(str(r["rank"]), r.get("host") or "", str(r.get("pid") or ""), r.get("device") or "",
                      str(r["step"]) if r.get("step") is not None else "", s(r.get("step_time_s")), s(r.get("busy_s")),
                      s(a.get("data_s")), s(a.get("compute_s")), s(a.get("comm_s")),
                      f"{r['rss_mb']:,.0f} MiB" if r.get("rss_mb") is not None else "",
                      f"{r['progress_age_s']:.1f} s ago" if r.get("progress_age_s") is not None else "",
                      r.get("exit") or "")
    _console().print(table)
    return 0


def make_action(action: str):
    def run(args) -> int:
        try:
            job = client(args).action(args.job, action)
        except ApiError as e:
            return report_error(e)
        requested = f" ({action} requested)" if job.get("requested_action") else ""
        _console().print(f"job {job['id']}: {job['state']}{requested}")
        return 0
    return run


def rule_body(args) -> dict:
    """`tokenpulse rules add` flags -> a POST /api/rules body (the server checks and names what is missing)."""
    body: dict = {"name": args.name, "severity": args.severity}
    if args.jobs:
        body.update(scope="name", pattern=args.jobs)
    elif args.job:
        body.update(scope="job", job_id=args.job)
    conditions = {"above": args.above is not None, "below": args.below is not None,
                  "no_improvement": args.no_improvement is not None, "jump": args.jump is not None,
                  "nonfinite": args.nonfinite, "state": args.state is not None}
    chosen = [k for k, on in conditions.items() if on]
    if len(chosen) != 1:
        raise SystemExit("say one condition: --above, --below, --no-improvement, --jump, --nonfinite or --state")
    body["condition"] = chosen[0]
    for key, value in (("metric", args.metric), ("threshold", args.above if args.above is not None else args.below),
                       ("steps", args.no_improvement), ("sigmas", args.jump), ("state", args.state)):
        if value is not None:
            body[key] = value
    if args.no_improvement is not None:
        body["mode"] = "max" if args.higher_is_better else "min"
    body["channels"] = ([{"url": u, "format": "slack"} for u in args.slack or []]
                        + [{"url": u, "format": "discord"} for u in args.discord or []]
                        + [{"url": u, "format": "json"} for u in args.webhook or []])
    return body


def rule_when(r: dict) -> str:
    c = r["condition"]
    return {"above": f"{r['metric']} > {r['threshold']:g}" if c == "above" else "",
            "below": f"{r['metric']} < {r['threshold']:g}" if c == "below" else "",
            "no_improvement": (f"{r['metric']} not better ({r['mode']}) for {r['steps']} steps"
                               if c == "no_improvement" else ""),
            "jump": f"{r['metric']} jumps {r['sigmas']:g} sigma" if c == "jump" else "",
            "nonfinite": f"{r['metric']} NaN or infinite", "state": f"job {r['state']}"}[c]


def cmd_rules(args) -> int:
    """Alert rules: list yours (an admin: all), add one, remove one (its open alerts clear)."""
    from rich.table import Table
    c, console = client(args), _console()
    try:
        if args.rules_cmd == "add":
            r = c.request("POST", "/api/rules", json=rule_body(args))
            console.print(f"rule {r['id']} ({r['name']}): alerts as 'rule:{r['id']}' when {rule_when(r)}")
        elif args.rules_cmd == "rm":
            out = c.request("DELETE", f"/api/rules/{args.id}")
            console.print(f"rule {args.id} removed ({out['cleared_alerts']} open alerts cleared)")
        else:
            table = Table("id", "name", "jobs", "when", "severity", "channels")
            for r in c.request("GET", "/api/rules"):
                jobs = {"all": "all", "name": r.get("pattern"), "job": f"job {r.get('job_id')}"}[r["scope"]]
                table.add_row(str(r["id"]), r["name"], jobs, rule_when(r), r["severity"],
                              ", ".join(ch["format"] for ch in r["channels"]))
            console.print(table)
    except ApiError as e:
        return report_error(e)
    return 0


def cmd_tokens(args) -> int:
    """Tokens for people (admin, user), agents and Prometheus (metrics): list, create (shown once),
    revoke. An admin manages every token; a user creates user tokens for itself and sees its own."""
    c, console = client(args), _console()
    try:
        if args.tokens_cmd == "create":
            t = c.create_token(args.name, args.role, allow_commands=args.allow_commands, gang=args.gang)
            rights = {"commands": "may submit command jobs" if t["role"] == "user" else "takes command jobs",
                      "gang": "joins multi-node jobs"}
            scopes = "".join(f", {rights[x]}" for x in t.get("scopes", []) if x in rights)
            console.print(f"{t['role']} token {t['id']} ({t['name']}{scopes}): [bold]{t['token']}[/]")
            console.print("shown once: only its hash is stored")
        elif args.tokens_cmd == "revoke":
            t = c.revoke_token(args.id)
            console.print(f"token {t['id']} ({t['name']}) revoked")
        else:
            from rich.table import Table
            table = Table("id", "name", "role", "scopes", "made by", "created", "revoked")
            when = lambda t: time.strftime("%Y-%m-%d %H:%M", time.localtime(t))  # noqa: E731
            for t in c.tokens():
                table.add_row(str(t["id"]), t["name"], t["role"], " ".join(t.get("scopes", [])),
                              str(t["created_by"]) if t.get("created_by") else "",
                              when(t["created_at"]), when(t["revoked_at"]) if t["revoked_at"] else "")
            console.print(table)
    except ApiError as e:
        return report_error(e)
    return 0


def open_fixes(c: Client, job_id: int) -> list:
    """The job's open fixes, numbered as the server numbers them (its open alerts, oldest first)."""
    alerts = sorted((a for a in c.alerts(job_id=job_id) if a["state"] != "cleared" and a.get("data")),
                    key=lambda a: a["id"])
    return [(a, f) for a in alerts for f in a["data"].get("fixes") or []]


def describe_change(ch: dict) -> str:
    where = ("from the pause's checkpoint" if ch["resume"] == "checkpoint" else
             f"from step 0 ({ch.get('why_fresh') or 'the checkpoint does not fit the change'})")
    lines = [f"#{ch['id']} {ch['kind']}: {ch.get('title') or ''} [{ch['state']}]",
             "  " + ", ".join(f"{k}: {v[0]} -> {v[1]}" for k, v in ch["changes"].items()),
             f"  relaunch {where}"]
    if ch.get("effect"):
        lines.append(f"  predicted: {ch['effect']}")
    cmp = ch.get("comparison") or {}
    if cmp.get("verdict") or cmp.get("waiting"):
        b, a = cmp.get("before") or {}, cmp.get("after") or {}

        def num(x, fmt="{:,.0f}"):
            return fmt.format(x) if isinstance(x, (int, float)) else "-"
        lines.append(f"  tokens/s {num(b.get('tokens_per_s'))} -> {num(a.get('tokens_per_s'))}; step time "
                     f"{num(b.get('step_time_s'), '{:.3g}')} s -> {num(a.get('step_time_s'), '{:.3g}')} s; ETA "
                     f"{num(b.get('eta_s'))} s -> {num(a.get('eta_s'))} s")
        lines.append(f"  {cmp.get('verdict') or cmp.get('waiting')}")
    return "\n".join(lines)


def cmd_fix(args) -> int:
    """`tokenpulse fix <job> [n]`: apply the n-th fix of the job's open verdicts (listed when several
    and no n), `--revert` the newest applied one, `--list` the fixes and every change so far."""
    c = client(args)
    con = _console()
    try:
        if args.list:
            for i, (a, f) in enumerate(open_fixes(c, args.job), 1):
                con.print(f"{i}. [{a['kind']}] {f.get('title')}: {f.get('effect') or ''}", markup=False)
            for ch in c.changes(args.job):
                con.print(describe_change(ch), markup=False)
            return 0
        if not args.revert and args.n is None:
            fixes = open_fixes(c, args.job)
            if len(fixes) > 1:
                con.print(f"job {args.job} has {len(fixes)} fixes; pick one: tokenpulse fix {args.job} <n>")
                for i, (a, f) in enumerate(fixes, 1):
                    con.print(f"{i}. [{a['kind']}] {f.get('title')}: {f.get('effect') or ''}", markup=False)
                return 2
        out = c.fix(args.job, n=args.n or 1, revert=args.revert)
    except ApiError as e:
        return report_error(e)
    job, ch = out["job"], out["change"]
    how = "pausing at the next step to apply it" if job.get("requested_action") == "pause" else "applied"
    con.print(f"job {job['id']}: {how}", markup=False)
    con.print(describe_change(ch), markup=False)
    return 0


def cmd_clone(args) -> int:
    changes = {}
    import yaml
    for kv in args.set or []:
        key, _, value = kv.partition("=")
        changes[key] = yaml.safe_load(value)
    try:
        job = client(args).clone(args.job, changes)
    except ApiError as e:
        return report_error(e)
    _console().print(f"job {job['id']} queued (clone of {args.job})")
    return 0


def cmd_analyze(args) -> int:
    spec = load_spec(args.spec) if args.spec else {}
    if args.dataset:
        spec["dataset"] = args.dataset
    if args.text_field:
        spec["text_field"] = args.text_field
    if args.messages_field:
        spec["messages_field"] = args.messages_field
    if args.model:  # its tokenizer (and chat template) decides the token lengths
        spec["model"] = args.model
    try:
        a = client(args).analyze(spec, measure=args.measure)
    except ApiError as e:
        return report_error(e)
    if args.json:
        print(json.dumps(a, indent=2))
        return 0
    from rich.table import Table

    from tokenpulse.protocol import DatasetAnalysis
    a = DatasetAnalysis.model_validate(a)  # the protocol's model: a renamed field fails here, by name
    console = _console()
    console.print(f"{a.examples:,} examples" + (f" (lengths from a sample of {a.sample_size:,})" if a.sampled else ""))
    console.print("token length: " + ", ".join(f"{k} {v:,.0f}" for k, v in a.percentiles.items()))
    console.print(f"[bold]recommended max_seq_length: {a.recommended_max_seq_length}[/] "
                  f"(at {a.max_seq_length} it truncates {a.truncated:,} example{'' if a.truncated == 1 else 's'})")
    # every layout at the same real tokens per step, as training runs them: only the padding differs
    table = Table("layout", "padding", "computed/step", "per real token", "vs max_length",
                  title=f"Each layout at {a.real_tokens_per_step:,.0f} real tokens per optimizer step",
                  caption="tokens computed (padding included) per step and per real token; "
                          "compute relative to padding every row to max_length")
    for name, s in a.layouts.items():
        table.add_row(name, f"{100 * s.padding_frac:.1f} %", f"{s.padded_tokens_per_step:,.0f}",
                      f"{s.computed_per_real_token:.2f}", f"{100 * s.compute_vs_max_length:.0f} %")
    console.print(table)
    mem = a.memory
    if mem:
        t = Table("max_seq_length", "largest micro-batch", "tokens/s", "limited by",
                  title=f"Measured on {mem['device']} ({mem['precision']}): rows of full length that fit")
        for m in mem["table"]:
            fits = (f"{m['max_rows']} row{'' if m['max_rows'] == 1 else 's'}" if m["fits"] else
                    "does not fit" if m["fits"] is False else "not measured")
            t.add_row(f"{m['seq_len']:,}", fits,
                      f"{m['tokens_per_s']:,.0f}" if m["fits"] else "", m["limited_by"])
        console.print(t)
    print_warnings(console, {"warnings": a.warnings})
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenpulse", description=__doc__)
    ap.add_argument("--url", default=None, help=f"server URL (env TOKENPULSE_URL, default {DEFAULT_URL})")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("up", help="start the server with an embedded worker")
    p.add_argument("--data-dir", type=Path, default=Path(os.environ.get("TOKENPULSE_DATA_DIR", "tokenpulse-data")))
    p.add_argument("--host", default=os.environ.get("TOKENPULSE_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("TOKENPULSE_PORT", "8765")))
    p.add_argument("--workers", type=int, default=1, help="embedded agent processes")
    p.add_argument("--no-worker", action="store_true", help="server only")
    p.add_argument("--demo", action="store_true", help="submit the demo job once up")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("server", help="start the server only")
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(fn=cmd_server)

    p = sub.add_parser("agent", help="run a worker agent that claims and trains jobs")
    p.add_argument("--server", default=os.environ.get("TOKENPULSE_URL", DEFAULT_URL))
    p.add_argument("--token")
    p.add_argument("--token-file")
    p.add_argument("--work-dir", default="tokenpulse-agent")
    p.add_argument("--name")
    p.add_argument("--capacity", type=int, help="jobs at once (default 1; with --slurm 8 Slurm jobs)")
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between heartbeats")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--max-jobs", type=int)
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument("--allow-commands", action="store_true",
                   help="take command jobs (tokenpulse run): code execution on this machine, as this user, "
                        "for anyone holding a token with the commands scope. Off unless given")
    p.add_argument("--address", help="host name or IP the other agents of a multi-node job reach this "
                   "machine by (its node may host the gang's rendezvous); default: this host's name")
    p.add_argument("--resume-root", action="append", metavar="DIR",
                   help="load checkpoints to resume from only under DIR (repeatable; default: the work "
                        "dir's parent). Put a shared checkpoint filesystem here to resume across machines")
    p.add_argument("--no-warm-start", action="store_true",
                   help="keep no zygote (a process with torch and transformers imported, ~0.5 GB, that "
                        "each job's training process is forked from): each starts plainly, importing "
                        "them again (also TOKENPULSE_WARM_START=0; =lazy starts it on the first job)")
    p.add_argument("--slurm", action="store_true",
                   help="run each claimed job as a Slurm batch job (sbatch/srun) instead of here: start it where "
                        "sbatch works; its work dir must be on storage the compute nodes share")
    p.add_argument("--partition", help="--slurm: the partition for jobs that name none")
    p.add_argument("--account", help="--slurm: the account for jobs that name none")
    p.add_argument("--sbatch-arg", action="append", metavar="ARG",
                   help="--slurm: an extra sbatch option for every job (repeatable), e.g. --sbatch-arg=--exclusive")
    p.set_defaults(fn=cmd_agent)

    p = sub.add_parser("submit", help="submit a job spec (YAML or JSON file, - for stdin)")
    p.add_argument("spec")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting")
    p.add_argument("-f", "--follow", action="store_true", help="watch it until it ends")
    p.add_argument("--test", action="store_true", help="first a quick test run: the whole job end to end on a "
                   "few steps (load, tokenize, train, eval, checkpoint, resume, save, reload); a failure ends it at "
                   "once")
    add_project_options(p)
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("run", help="run your own command as a job: tokenpulse run [options] -- python train.py ...",
                       description="Run a command (your training script) as a job on an agent that takes "
                                   "command jobs: supervised, its output logged, cancellable. Everything after "
                                   "-- is the command, run as given (no shell).")
    p.add_argument("--name", help="a label (default: the command)")
    p.add_argument("--cwd", help="working directory on the agent (default: the current directory)")
    p.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="an environment variable (repeatable); a plain setting, shown on the job page")
    p.add_argument("--secret-env", action="append", metavar="NAME",
                   help="pass this variable from the agent's own environment (repeatable): for tokens and "
                        "keys; its value is never sent to or stored by the server")
    p.add_argument("--priority", type=int)
    p.add_argument("--max-retries", type=int)
    p.add_argument("--no-instrument", action="store_true",
                   help="do not add tokenpulse's reporting hook (Trainer/tqdm progress, metrics) to the job")
    p.add_argument("-f", "--follow", action="store_true", help="watch it until it ends (Ctrl+C stops watching only)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    add_project_options(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("demo", help="submit the built-in demo job and watch it")
    p.add_argument("--no-follow", action="store_true")
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps (default 200, about 20 s on 2 CPU cores)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("watch", help="follow a job until it ends")
    p.add_argument("job", type=int)
    p.set_defaults(fn=cmd_watch)

    p = sub.add_parser("jobs", help="list jobs")
    p.add_argument("--state")
    p.add_argument("-q")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--project", help="only this project's jobs")
    p.add_argument("--tag", action="append", help="only jobs with this tag (repeatable: all of them)")
    p.set_defaults(fn=cmd_jobs)

    cli_runs.add_commands(sub, report_error)

    p = sub.add_parser("show", help="a job's full record as JSON, with its step anatomy and open verdicts")
    p.add_argument("job", type=int)
    p.add_argument("--attempts", action="store_true",
                   help="a table of its attempts instead: outcome, failure class, change, decision")
    p.set_defaults(fn=cmd_show)

    p = sub.add_parser("logs",
                       help="a job's log: the whole of it, or the lines matching --grep; --follow for new lines")
    p.add_argument("job", type=int)
    p.add_argument("--grep", help="only lines containing this text (case-insensitive)")
    p.add_argument("--regex", action="store_true", help="--grep is a regular expression")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--tail", type=int, default=0, help="only the last N lines (matches) to start with")
    p.add_argument("--streams", action="store_true", help="prefix each line with its stream (stdout, stderr, agent)")
    p.set_defaults(fn=cmd_logs)

    p = sub.add_parser("mcp", help="serve the Model Context Protocol over stdio, for coding agents "
                                   "(TOKENPULSE_URL, TOKENPULSE_TOKEN: the agent gets this token's rights)")
    p.set_defaults(fn=cmd_mcp)

    p = sub.add_parser("ranks",
                       help="a distributed job's ranks (host, pid, step, step time, data/compute/comm, memory)")
    p.add_argument("job", type=int)
    p.set_defaults(fn=cmd_ranks)

    for action in ("cancel", "pause", "resume"):
        p = sub.add_parser(action, help=f"{action} a job")
        p.add_argument("job", type=int)
        p.set_defaults(fn=make_action(action))

    p = sub.add_parser("fix", help="apply a verdict's fix to a running job (checkpoint, relaunch with the change, "
                                   "compare before/after), or --revert it")
    p.add_argument("job", type=int)
    p.add_argument("n", type=int, nargs="?", help="which fix when the job's verdicts carry several (see --list)")
    p.add_argument("--revert", action="store_true", help="undo the newest applied fix")
    p.add_argument("--list", action="store_true", help="the open fixes and every change so far, with before/after")
    p.set_defaults(fn=cmd_fix)

    p = sub.add_parser("clone", help="start a job again (retry), optionally with changed settings")
    p.add_argument("job", type=int)
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.set_defaults(fn=cmd_clone)

    p = sub.add_parser("rules", help="alert rules: list, add, rm (a metric above/below, no improvement, a jump, "
                                     "NaN, a job state; Slack/Discord webhooks)")
    rsub = p.add_subparsers(dest="rules_cmd")
    rsub.add_parser("list", help="your rules (an admin: all)")
    a = rsub.add_parser("add", help="add a rule, e.g. `rules add plateau --metric eval/loss --no-improvement 500`")
    a.add_argument("name")
    a.add_argument("--metric", help="the logged metric it watches (eval/loss, loss, grad_norm, ...)")
    a.add_argument("--above", type=float, metavar="VALUE")
    a.add_argument("--below", type=float, metavar="VALUE")
    a.add_argument("--no-improvement", type=int, metavar="STEPS", help="no new best for this many steps")
    a.add_argument("--higher-is-better", action="store_true", help="with --no-improvement: best is the highest")
    a.add_argument("--jump", type=float, metavar="SIGMAS",
                   help="a value this many standard deviations from the recent mean")
    a.add_argument("--nonfinite", action="store_true", help="the metric is NaN or infinite")
    a.add_argument("--state", choices=["failed", "completed", "cancelled", "stalled"])
    a.add_argument("--jobs", metavar="GLOB", help="only jobs whose name matches (sft-*); default all jobs")
    a.add_argument("--job", type=int, help="only this job")
    a.add_argument("--severity", choices=["info", "warning", "critical"], default="warning")
    a.add_argument("--slack", action="append", metavar="URL", help="a Slack incoming webhook (repeatable)")
    a.add_argument("--discord", action="append", metavar="URL", help="a Discord webhook (repeatable)")
    a.add_argument("--webhook", action="append", metavar="URL", help="any receiver of the alert as JSON (repeatable)")
    r = rsub.add_parser("rm", help="remove a rule (its open alerts clear)")
    r.add_argument("id", type=int)
    p.set_defaults(fn=cmd_rules)

    p = sub.add_parser("tokens", help="list, create or revoke access tokens (admin, user, agent, metrics)")
    tsub = p.add_subparsers(dest="tokens_cmd")
    tsub.add_parser("list", help="the tokens you manage (an admin: all), never the secrets")
    t = tsub.add_parser("create", help="a new token, shown once")
    t.add_argument("name")
    t.add_argument("--role", choices=("admin", "user", "agent", "metrics"), default="agent",
                   help="admin: everything, every token; user: submits, watches and controls its own jobs; "
                        "agent: only claims jobs and reports events; metrics: only reads /metrics (Prometheus). "
                        "Only an admin creates admin, agent and metrics tokens")
    t.add_argument("--allow-commands", action="store_true",
                   help="a user token may also submit command jobs (run code on agents); an agent token may "
                        "take them (its agent may start with --allow-commands)")
    t.add_argument("--gang", action="store_true",
                   help="(agent tokens, admin only) may join multi-node jobs: every node of a gang can be made "
                        "to run code by node rank 0, so give it only to machines you trust alike")
    t = tsub.add_parser("revoke", help="refuse a token from now on")
    t.add_argument("id", type=int)
    p.set_defaults(fn=cmd_tokens)

    p = sub.add_parser("db", help="database operations: backup")
    dsub = p.add_subparsers(dest="db_cmd", required=True)
    d = dsub.add_parser("backup", help="an online backup (SQLite: a checked copy; PostgreSQL: pg_dump)")
    d.add_argument("out", help="file to write")
    d.add_argument("--data-dir", type=Path, help="the server's data directory (default: TOKENPULSE_DATA_DIR "
                                                  "or ./tokenpulse-data); TOKENPULSE_DATABASE_URL is honoured")
    d.set_defaults(fn=cmd_db)

    p = sub.add_parser("analyze", help="token length analysis and recommended max_seq_length")
    p.add_argument("spec", nargs="?", help="job spec file (model, dataset, fields)")
    p.add_argument("--dataset")
    p.add_argument("--text-field")
    p.add_argument("--messages-field", help="chat data: the column of {role, content} lists")
    p.add_argument("--model", help="whose tokenizer to count with (a local directory or a Hub id)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--measure", type=float, default=0, metavar="SECONDS",
                   help="also measure, per candidate sequence length, the largest micro-batch that fits and its "
                        "tokens/s")
    p.set_defaults(fn=cmd_analyze)

    args = ap.parse_args(argv)
    import httpx
    try:
        return args.fn(args) or 0
    except httpx.ConnectError:
        url = args.url or os.environ.get("TOKENPULSE_URL") or DEFAULT_URL
        _console().print(f"[red]error[/] cannot reach tokenpulse at {url}: is the server running? "
                         "(start it with `make up`, or set TOKENPULSE_URL)")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
