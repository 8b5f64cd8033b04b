"""The CLI for many runs: a job's project, tags and note (`tokenpulse edit`), the projects, and
sweeps (`tokenpulse sweep sweep.yaml`, `tokenpulse sweeps [ID]`). Registered by tokenpulse/cli.py."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from tokenpulse.client import ApiError, Client


def add_project_options(p) -> None:
    p.add_argument("--project", help="the project the job belongs to (default: the spec's, else 'default')")
    p.add_argument("--tag", action="append", help="a tag (repeatable)")


def add_commands(sub, report_error: Callable[[ApiError], int]) -> None:
    def run(fn):
        def call(args) -> int:
            try:
                return fn(Client(args.url), args)
            except ApiError as e:
                return report_error(e)
        return call

    p = sub.add_parser("edit", help="a job's project, tags or note: tokenpulse edit 12 --tag base --note 'lr high'")
    p.add_argument("job", type=int)
    p.add_argument("--project", help="move it to this project")
    p.add_argument("--tag", action="append", default=[], help="add a tag (repeatable)")
    p.add_argument("--untag", action="append", default=[], help="remove a tag (repeatable)")
    p.add_argument("--note", help="its note (markdown); - reads it from stdin")
    p.set_defaults(fn=run(cmd_edit))

    p = sub.add_parser("projects", help="list projects: jobs, active jobs and sweeps in each")
    p.set_defaults(fn=run(cmd_projects))

    p = sub.add_parser("sweep", help="start a sweep (YAML or JSON file, - for stdin): trials of a base job "
                                     "over a space of settings, pruned early, within a budget")
    p.add_argument("spec", help="the sweep file: base job, space, method, objective, budget, pruner (- for stdin)")
    add_project_options(p)
    p.set_defaults(fn=run(cmd_sweep))

    p = sub.add_parser("sweeps", help="list sweeps, or show one's trials; --pause/--resume/--cancel it")
    p.add_argument("sweep", type=int, nargs="?")
    p.add_argument("--project", help="only this project's sweeps")
    for action in ("pause", "resume", "cancel"):
        p.add_argument(f"--{action}", action="store_true", help=f"{action} the sweep")
    p.set_defaults(fn=run(cmd_sweeps))


def _console():
    from rich.console import Console
    return Console()


def cmd_edit(c: Client, args) -> int:
    fields: dict = {"add_tags": args.tag, "remove_tags": args.untag}
    if args.project:
        fields["project"] = args.project
    if args.note is not None:
        fields["note"] = sys.stdin.read() if args.note == "-" else args.note
    job = c.edit(args.job, **fields)
    _console().print(f"job {job['id']}: project {job['project']}, tags {' '.join(job['tags']) or '-'}"
                     + (", note saved" if args.note is not None else ""), highlight=False)
    return 0


def cmd_projects(c: Client, args) -> int:
    from rich.table import Table
    table = Table("project", "jobs", "active", "sweeps")
    for p in c.projects():
        table.add_row(p["project"], str(p["jobs"]), str(p["active"]), str(p["sweeps"]))
    _console().print(table)
    return 0


def cmd_sweep(c: Client, args) -> int:
    import yaml
    text = sys.stdin.read() if args.spec == "-" else Path(args.spec).read_text()
    spec = yaml.safe_load(text) or {}
    if not isinstance(spec, dict):
        raise SystemExit(f"{args.spec}: a sweep is a mapping (base, parameters, objective...; see README)")
    if args.project:
        spec["project"] = args.project
    if args.tag:
        spec["tags"] = list(dict.fromkeys([*spec.get("tags", []), *args.tag]))
    sweep = c.sweep(spec)
    _console().print(f"sweep [bold]{sweep['id']}[/] ({sweep['name']}) started: {c.url}/sweeps/{sweep['id']}")
    return 0


def cmd_sweeps(c: Client, args) -> int:
    from rich.table import Table
    console = _console()
    if args.sweep is None:
        table = Table("id", "name", "project", "state", "method", "objective", "trials", "best")
        for s in c.sweeps(args.project):
            best = s["best"]
            table.add_row(str(s["id"]), s["name"], s["project"], s["state"], s["method"],
                          f"{s['objective']['metric']} ({s['objective']['goal']})", str(s["trials"]),
                          f"{best['value']:.4g} (#{best['number']})" if best else "")
        console.print(table)
        return 0
    for action in ("pause", "resume", "cancel"):
        if getattr(args, action):
            s = c.sweep_action(args.sweep, action)
            console.print(f"sweep {s['id']} is {s['state']}")
            return 0
    s = c.sweep_detail(args.sweep)
    table = Table("#", "job", *s["parameters"], "state", s["objective"]["metric"], "pruned at", "reason",
                  title=f"sweep {s['id']} ({s['name']}): {s['state']}")
    for t in s["trials"]:
        table.add_row(str(t["number"]), str(t["job_id"]), *[str(t["params"].get(p, "")) for p in s["parameters"]],
                      t["state"], "" if t["value"] is None else f"{t['value']:.4g}",
                      "" if t["pruned_step"] is None else str(t["pruned_step"]), t["reason"] or "")
    console.print(table)
    if s["best"]:
        console.print(f"best: #{s['best']['number']} (job {s['best']['job_id']}) {s['best']['value']:.4g} "
                      f"with {s['best']['params']}", highlight=False)
    return 0
