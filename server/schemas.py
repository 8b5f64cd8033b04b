"""What the public REST routes answer, as pydantic models, so /docs shows it and a route cannot
drop a field the UI (web/static/*.js) or the CLI (tokenpulse/cli.py) reads.

Server-side answer shapes only; request bodies and the agent's shapes live in tokenpulse/protocol.py.
Kept in one flat module so any of them can move to protocol.py when a client starts reading it typed
(as the dataset analysis did: protocol.DatasetAnalysis).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tokenpulse.protocol import Number  # int first: a step stays 12, not 12.0


class Answer(BaseModel):
    """A route's answer. extra="forbid": a field the code adds but the model lacks fails loudly (a
    500 in the tests) instead of being dropped silently from the answer, so the model, /docs and
    what the UI reads cannot drift apart."""
    model_config = ConfigDict(extra="forbid")


class Health(Answer):
    ok: bool
    reaper: bool = Field(True, description="this server process runs the reaper (one of several on PostgreSQL does)")


class JobSummary(Answer):
    """A row of the jobs list; also the `job` of a websocket 'job' frame and of control answers."""
    id: int
    name: str
    kind: str = Field("train", description="train (a JobSpec run by tokenpulse) or command (your own command)")
    state: str = Field(description="queued, starting, running, paused, completed, failed, cancelled")
    priority: int
    parent_id: Optional[int] = Field(description="the job this one was cloned or retried from")
    created_at: float
    started_at: Optional[float]
    finished_at: Optional[float]
    agent_id: Optional[int] = Field(description="the agent running it now")
    attempt: int
    phase: Optional[dict[str, Any]] = Field(description="the latest phase event's data (name, done, total, ...)")
    step: Optional[int]
    total_steps: Optional[int]
    last: dict[str, Union[Number, Literal["nan", "inf", "-inf"]]] = Field(
        description="latest values and their step: a list's rows and live frames carry the listed metrics and "
                    "the columns asked for, a job's own page every metric; a NaN/inf value as its word")
    alive_at: Optional[float] = Field(description="when the training process last said it was alive")
    reason: Optional[str]
    failure: Optional[str] = Field(description="failure kind of the last attempt: oom, nan, crash, lost, hang, spec...")
    exit_code: Optional[int]
    signal: Optional[str]
    requested_action: Optional[str] = Field(description="cancel or pause, until the job ends (a cancel wins)")
    stack_requested: bool = Field(False, description="a stack dump is asked for and the agent has not taken it yet")
    checkpoint: Optional[str] = Field(description="newest checkpoint the server recorded (resumes start here)")
    output_dir: Optional[str] = Field(description="the final model's directory")
    owner: Optional[int] = Field(None, description="the token that submitted it (its user's, for a token a user "
                                                   "created); only it or an admin may control the job. None: "
                                                   "from before owners existed, the admin's")
    project: str = Field("default", description="the project it belongs to")
    tags: list[str] = Field(default_factory=list, description="its tags")
    sweep_id: Optional[int] = Field(None, description="the sweep it is a trial of")


class AttemptOut(Answer):
    attempt: int
    agent_id: Optional[int]
    started_at: float
    ended_at: Optional[float]
    outcome: Optional[str] = Field(description="retried, paused, queued or a final state")
    reason: Optional[str]
    failure: Optional[str]
    exit_code: Optional[int]
    signal: Optional[str]
    resumed_from: Optional[str]
    failure_class: Optional[str] = Field(None, description="the failure's class for the retry policy: oom, hang, "
                                         "preempted, data, collective_timeout, crash, signal, lost, spec, nan, ...")
    change: Optional[dict[str, Any]] = Field(None, description="the change made for the next attempt, "
                                             "e.g. {\"batch_size\": [8, 4], \"grad_accum\": [1, 2]}")
    decision: Optional[str] = Field(None, description="why the next attempt was (not) made")
    hang_step: Optional[int] = Field(None, description="a hang: the step it was stuck at")
    hang_frame: Optional[str] = Field(None, description="a hang: the frame it was stuck in")
    peak_mb: Optional[float] = Field(None, description="the peak memory the attempt reached (MiB), where known")
    checkpoint_s: Optional[float] = Field(None, description="seconds from a checkpoint request (pause, stop, "
                                          "SIGTERM from outside) to the saved checkpoint")


class JobDetail(JobSummary):
    spec: dict[str, Any] = Field(description="the JobSpec (or CommandSpec) as stored (after any OOM retry's "
                                             "batch change)")
    info: dict[str, Any] = Field(description="automatic choices the training process reported")
    attempts: list[AttemptOut]
    note: str = Field("", description="its markdown note")


class PreflightWarning(BaseModel):
    kind: str = Field(description="truncation, padding, batch_size, streaming_epochs")
    field: str = Field(description="the JobSpec setting it is about")
    message: str
    fix: str = Field(description="the suggested change")


class PreflightOut(BaseModel):
    analysis: str = Field(description="the data analysis behind the warnings: not needed (automatic settings), "
                                      "done, cached, pending (still running; a later submit finds it), failed")
    seconds: float = Field(description="time the submit spent on preflight")


class Submitted(JobDetail):
    """A created job, with the submit's preflight advice (the job runs as asked regardless)."""
    warnings: list[PreflightWarning] = Field(default_factory=list)
    preflight: Optional[PreflightOut] = None


class JobListRow(JobSummary):
    last_agent_id: Optional[int] = Field(description="the agent of the latest attempt (a finished job holds none)")
    spec: Optional[dict[str, Any]] = Field(None, description="its settings, with ?spec=true")


class JobList(Answer):
    total: int
    jobs: list[JobListRow]
    metric_names: Optional[list[str]] = Field(None, description="with names=true: the metric names the page's "
                                                                "jobs logged (a column picker's choices)")


class Series(Answer):
    step: list[int]
    t: list[float]
    value: list[float]
    downsampled: bool
    total_points: Optional[int] = Field(None, description="points stored, when downsampled")


class MetricsOut(Answer):
    job_id: int
    attempt: int = Field(description="the attempt whose points these are")
    series: dict[str, Series] = Field(description="by metric name")


class EventOut(Answer):
    seq: int
    t: float
    kind: str
    data: dict[str, Any]


class EventsOut(Answer):
    job_id: int
    events: list[EventOut]


class AlertOut(Answer):
    id: int
    job_id: Optional[int]
    agent_id: Optional[int]
    kind: str
    severity: str
    state: Literal["open", "acked", "cleared"]
    message: str
    stack: Optional[str] = Field(description="every thread's stack of a stalled process, when captured")
    created_at: float
    updated_at: float
    cleared_at: Optional[float]
    data: Optional[dict[str, Any]] = Field(None, description="the verdict's structure: `fixes` (each a spec or "
                                           "command change with its predicted effect, applied by POST "
                                           "/api/jobs/{id}/fix) and `costs` (each cause's share of the step "
                                           "time and the hours it costs of the remaining ETA)")
    job_name: Optional[str] = Field(None, description="the job's name (the alerts list)")
    rule_name: Optional[str] = Field(None, description="a rule's alert (kind rule:<id>): the rule's name")


class TokenOut(Answer):
    id: int
    name: str
    role: Literal["admin", "user", "agent", "metrics"]
    scopes: list[str] = Field(default_factory=list, description="extra rights: 'commands' (a user submits command "
                                                                "jobs, an agent takes them), 'gang' (an agent joins "
                                                                "multi-node jobs)")
    created_by: Optional[int] = Field(None, description="the token that created it (none: made at first start)")
    created_at: float
    revoked_at: Optional[float]


class Me(Answer):
    """Who the calling token is: what the UI needs to show only the controls that will work."""
    id: int
    role: str
    scopes: list[str]
    principal: int = Field(description="whose jobs are this token's (a job's `owner`)")
    may_run_commands: bool


class NewTokenOut(TokenOut):
    token: str = Field(description="the token itself: shown this once, stored only as a hash")


class AgentOut(Answer):
    id: int
    name: str
    host: str
    device: str
    capacity: int
    accepts_commands: bool = Field(False, description="started with --allow-commands: takes command jobs")
    state: str = Field(description="online, lost or stopped")
    created_at: float
    seen_at: float
    jobs: list[int] = Field(description="ids of the jobs it holds")
    system: Optional[dict] = Field(None, description="its machine's latest sample (protocol.MachineSample): "
                                                     "CPU %, memory, network, GPUs; None until the first")
