"""The schema. Alembic migrations in migrations/ are its history; a test checks they agree."""
from __future__ import annotations

from typing import Optional

from sqlalchemy import BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, case, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# 64-bit integers on both stores: SQLite's INTEGER is 64-bit already (and must stay INTEGER for rowid
# primary keys); on PostgreSQL the values bound in queries are BIGINT, so a step or id up to 2**63 - 1
# works as on SQLite (server/dialect.py makes the columns BIGINT too).
Int = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Int, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="train", server_default="train")  # train, command
    spec: Mapped[str] = mapped_column(Text)  # JobSpec (kind train) or CommandSpec (kind command) as JSON
    priority: Mapped[int] = mapped_column(Int, default=0)
    parent_id: Mapped[Optional[int]] = mapped_column(ForeignKey("jobs.id"), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    finished_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    # indexed: heartbeats and event batches look up "this agent's jobs" (pending commands)
    agent_id: Mapped[Optional[int]] = mapped_column(ForeignKey("agents.id"), nullable=True, index=True)
    attempt: Mapped[int] = mapped_column(Int, default=0)
    requested_action: Mapped[Optional[str]] = mapped_column(String(16), nullable=True)  # cancel or pause
    stack_requested_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)  # one-shot, apart
    # Live summary, updated by ingest so the jobs list needs no join over metrics.
    phase: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # PhaseData JSON
    step: Mapped[Optional[int]] = mapped_column(Int, nullable=True)
    total_steps: Mapped[Optional[int]] = mapped_column(Int, nullable=True)
    last: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # latest metric values JSON
    alive_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    next_seq: Mapped[int] = mapped_column(Int, default=0)
    reason: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    failure: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)
    exit_code: Mapped[Optional[int]] = mapped_column(Int, nullable=True)
    signal: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)
    checkpoint: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    output_dir: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    info: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # automatic choices JSON
    nnodes: Mapped[int] = mapped_column(Integer, default=1, server_default="1")  # > 1: claimed by a gang of agents
    # The token that submitted it: only it (or an admin) may control it. NULL: from before owners
    # existed (migration 0009), treated as the admin's.
    owner_token_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True, index=True)
    # An external job's own credential (hashed): only it (or an admin) may post the job's events.
    report_hash: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    # Many runs (migration 0016): its project, tags (a JSON list) and markdown note, editable after
    # submit; the sweep it is a trial of.
    project: Mapped[str] = mapped_column(String(100), default="default", server_default="default", index=True)
    tags: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    note: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    sweep_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True, index=True)

    __table_args__ = (Index("ix_jobs_queue", "state", "priority", "id"),)


# A new attempt's summary (a claim): its step is the checkpoint's (kept) where it resumes from one,
# none yet where it starts from step 0.
NEW_ATTEMPT_STEP = case((Job.checkpoint.is_(None), None), else_=Job.step)


class Agent(Base):
    __tablename__ = "agents"
    id: Mapped[int] = mapped_column(Int, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(500))
    capacity: Mapped[int] = mapped_column(Int, default=1)
    state: Mapped[str] = mapped_column(String(16))  # online, lost, stopped
    created_at: Mapped[float] = mapped_column(Float)
    seen_at: Mapped[float] = mapped_column(Float)
    # The token that registered it: only that token may act as this agent (revoking it stops it).
    token_id: Mapped[Optional[int]] = mapped_column(Int, nullable=True)
    # Started with --allow-commands: only such agents are handed command jobs (code execution).
    accepts_commands: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # A stable id of the agent's work dir on its host: a restarted agent registers under the same row.
    instance: Mapped[Optional[str]] = mapped_column(String(64), nullable=True, index=True)
    # Its machine's latest system summary (JSON; POST /api/agents/{id}/system every few seconds), in
    # the database so that every server process on it shows the same workers page.
    machine: Mapped[Optional[str]] = mapped_column(Text, nullable=True)


class Attempt(Base):
    """One run of a job on one agent, and why it ended."""
    __tablename__ = "attempts"
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Int, primary_key=True)
    agent_id: Mapped[Optional[int]] = mapped_column(ForeignKey("agents.id"), nullable=True)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    outcome: Mapped[Optional[str]] = mapped_column(String(16), nullable=True)
    reason: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    failure: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)  # oom, nan, crash, lost, spec...
    exit_code: Mapped[Optional[int]] = mapped_column(Int, nullable=True)
    signal: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)
    resumed_from: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # checkpoint it started from
    # the retry policy's account (migration 0013): the failure's class (oom, hang, preempted, data,
    # collective_timeout, ...), the change made for the next attempt ({"batch_size": [8, 4], ...}, JSON),
    # why the next attempt was (not) made; a hang's step and frame (compared with the next hang's);
    # the peak memory it reached (MiB); seconds from a checkpoint request (pause, stop, SIGTERM) to
    # its saved checkpoint
    failure_class: Mapped[Optional[str]] = mapped_column(String(32), nullable=True)
    change: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    decision: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    hang_step: Mapped[Optional[int]] = mapped_column(Int, nullable=True)
    hang_frame: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    peak_mb: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    checkpoint_s: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class Event(Base):
    """Every event but metrics (which go to the lean metrics table) and heartbeats."""
    __tablename__ = "events"
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(Int, primary_key=True)
    t: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    data: Mapped[str] = mapped_column(Text)


class MetricKey(Base):
    __tablename__ = "metric_keys"
    id: Mapped[int] = mapped_column(Int, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)


class Metric(Base):
    """One number: the table is lean on purpose (WITHOUT ROWID, integer key ids): ~40 bytes a point.
    The primary key (job, key, attempt, step) makes a replayed point overwrite itself (stored exactly
    once) while a later attempt's point at the same step is a point of its own (migration 0015): a
    fix that restarts from step 0 never overwrites the run it is compared with."""
    __tablename__ = "metrics"
    job_id: Mapped[int] = mapped_column(Int, primary_key=True)
    key_id: Mapped[int] = mapped_column(Int, primary_key=True)
    attempt: Mapped[int] = mapped_column(Int, primary_key=True)
    step: Mapped[int] = mapped_column(Int, primary_key=True)
    t: Mapped[float] = mapped_column(Float)
    value: Mapped[float] = mapped_column(Float)
    __table_args__ = ({"sqlite_with_rowid": False},)


class MetricRollup(Base):
    """Per 256 steps of one (job, key, attempt): count, first, last, min and max point (step, t, value).
    Kept by ingest, so a chart of a million points reads ~4,000 of these instead of the points."""
    __tablename__ = "metric_rollups"
    job_id: Mapped[int] = mapped_column(Int, primary_key=True)
    key_id: Mapped[int] = mapped_column(Int, primary_key=True)
    attempt: Mapped[int] = mapped_column(Int, primary_key=True)
    bucket: Mapped[int] = mapped_column(Int, primary_key=True)  # step >> 8
    n: Mapped[int] = mapped_column(Int)
    first_step: Mapped[int] = mapped_column(Int)
    first_t: Mapped[float] = mapped_column(Float)
    first_value: Mapped[float] = mapped_column(Float)
    last_step: Mapped[int] = mapped_column(Int)
    last_t: Mapped[float] = mapped_column(Float)
    last_value: Mapped[float] = mapped_column(Float)
    min_step: Mapped[int] = mapped_column(Int)
    min_t: Mapped[float] = mapped_column(Float)
    min_value: Mapped[float] = mapped_column(Float)
    max_step: Mapped[int] = mapped_column(Int)
    max_t: Mapped[float] = mapped_column(Float)
    max_value: Mapped[float] = mapped_column(Float)
    __table_args__ = ({"sqlite_with_rowid": False},)


class Alert(Base):
    __tablename__ = "alerts"
    id: Mapped[int] = mapped_column(Int, primary_key=True)
    job_id: Mapped[Optional[int]] = mapped_column(ForeignKey("jobs.id"), nullable=True, index=True)
    agent_id: Mapped[Optional[int]] = mapped_column(ForeignKey("agents.id"), nullable=True)
    kind: Mapped[str] = mapped_column(String(64))
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), index=True)  # open, acked, cleared
    message: Mapped[str] = mapped_column(Text)
    stack: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    cleared_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    data: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # JSON: a verdict's fixes and costs


class AlertRule(Base):
    """A rule a person wrote (server/rules.py evaluates it on ingest): its alerts are kind 'rule:<id>'."""
    __tablename__ = "alert_rules"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    owner_token_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True, index=True)
    scope: Mapped[str] = mapped_column(String(8))  # all, name, job
    pattern: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    job_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    condition: Mapped[str] = mapped_column(String(16))  # above, below, no_improvement, jump, nonfinite, state
    metric: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    threshold: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    steps: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    sigmas: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    mode: Mapped[Optional[str]] = mapped_column(String(4), nullable=True)
    state: Mapped[Optional[str]] = mapped_column(String(16), nullable=True)
    severity: Mapped[str] = mapped_column(String(16))
    channels: Mapped[str] = mapped_column(Text)  # JSON: [{"url": ..., "format": "slack" | "discord" | "json"}]
    created_at: Mapped[float] = mapped_column(Float)


class Token(Base):
    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(Int, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(16))  # admin, user, agent, metrics
    # Space-separated extra rights: "commands" (a user: submit command jobs; an agent: take them),
    # "gang" (an agent: join multi-node jobs).
    scopes: Mapped[str] = mapped_column(String(200), default="", server_default="")
    # The token that minted it (NULL: the first start or before 0009): a user sees and revokes its own.
    created_by: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class BrowserSession(Base):
    """A login: the cookie holds a secret whose hash is here. Logout revokes it; it expires."""
    __tablename__ = "sessions"
    id: Mapped[int] = mapped_column(Int, primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_id: Mapped[int] = mapped_column(Int, ForeignKey("tokens.id"))
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)



class JobRank(Base):
    """One rank of a distributed job, as its agent last reported it (heartbeats): who it is and how
    far it got. Rows of the current attempt; a new attempt's ranks replace them."""
    __tablename__ = "job_ranks"
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    agent_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    host: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    pid: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    device: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    step: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    step_time_s: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    busy_s: Mapped[Optional[float]] = mapped_column(Float, nullable=True)  # its own work per step, waits left out
    rss_mb: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    alive_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    progress_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    exit: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    # a rank's stacks (py-spy), sent by another node's agent when asked, for node rank 0's verdict
    stack: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)


class GangMember(Base):
    """An agent's share of a multi-node job (nnodes > 1) for one attempt: its node rank and, for node
    rank 0, the rendezvous endpoint it advertised. Rows of an attempt still forming (the job queued,
    attempt = job.attempt + 1) are the gang being gathered; all or nothing within gang_timeout_s."""
    __tablename__ = "gang_members"
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    agent_id: Mapped[int] = mapped_column(Integer, index=True)
    endpoint: Mapped[Optional[str]] = mapped_column(String(300), nullable=True)  # host:port (node rank 0)
    # node rank 0's agent asked this member for its ranks' stacks (a stall): handed out once
    stack_requested_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    joined_at: Mapped[float] = mapped_column(Float)
    handed_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)  # its claim answer was given


class JobChange(Base):
    """A fix applied to a job (server/fixes.py): the spec change, who asked, the attempts before and
    after, the measurements before it (taken when it was asked for) and the
    verdict once the new attempt has run long enough to compare."""
    __tablename__ = "job_changes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(32))  # padding, micro_batch, precision, eval, workers, revert...
    state: Mapped[str] = mapped_column(String(16))  # pending (waiting for the checkpoint), applied, refused
    alert_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    reverts: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)  # the change this one undoes
    changes: Mapped[str] = mapped_column(Text)  # JSON {field: [old, new]}
    fix: Mapped[str] = mapped_column(Text)  # JSON: the fix as the verdict gave it (effect, resume, why_fresh)
    resume: Mapped[str] = mapped_column(String(16))  # checkpoint or fresh
    by_token_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    applied_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    from_attempt: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    to_attempt: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    resume_step: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)  # the new attempt starts after it
    before: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # JSON: the attempt's measurements
    verdict: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # JSON: the comparison, once fair


class Sweep(Base):
    """A search over a base spec's settings (server/sweeps/): its trials are ordinary jobs."""
    __tablename__ = "sweeps"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    project: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(16))  # running, paused, completed, cancelled
    spec: Mapped[str] = mapped_column(Text)  # SweepSpec JSON (tokenpulse/sweep_spec.py)
    owner_token_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    reason: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # why it ended
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class SweepTrial(Base):
    """One trial: its job, its settings and Optuna's own state of it (system_attrs: the grid point, a
    pruner's rungs), enough to rebuild the study after a restart; intermediate values are the job's
    stored objective series."""
    __tablename__ = "sweep_trials"
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)  # Optuna's trial number
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    params: Mapped[str] = mapped_column(Text)  # JSON {name: value}
    system_attrs: Mapped[str] = mapped_column(Text)  # JSON
    state: Mapped[str] = mapped_column(String(16))  # running, complete, pruned, failed
    value: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    pruned_step: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    reason: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
