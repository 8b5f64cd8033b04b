"""One Settings object for the server: environment variables TOKENPULSE_*, or flags of `tokenpulse`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenpulse.limits import METRIC_NAMES_PER_JOB


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENPULSE_", extra="ignore")

    data_dir: Path = Field(Path("tokenpulse-data"), description="SQLite file, tokens, job outputs")
    database_url: Optional[str] = Field(None, description="default: sqlite in data_dir; any SQLAlchemy URL")
    host: str = "127.0.0.1"
    port: int = 8765

    agent_lost_after_s: float = Field(30.0, description="an agent silent this long is lost")
    max_preemptions: int = Field(20, ge=0, description="times one job is requeued after a preemption; one "
                                 "more fails it, naming this cap (a job preempted forever never ends otherwise)")
    gang_timeout_s: float = Field(60.0, gt=0, description="a multi-node job's gang must gather within this; "
                                  "else its agents are released")
    reaper_every_s: float = 2.0
    busy_timeout_s: float = Field(30.0, gt=0, description="how long a write waits for another process's "
                                  "lock on the SQLite file before answering 503")
    # Paths a job may name (model, dataset). Empty: anywhere the server's user can read.
    path_roots: list[Path] = Field(default_factory=list)
    allow_remote_code: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    webhooks: list[str] = Field(default_factory=list, description="URLs that receive alerts as JSON")
    webhook_timeout_s: float = 5.0
    webhook_retries: int = 3
    webhook_allow: list[str] = Field(default_factory=list, description=(
        "hosts (example.internal) or networks (10.1.0.0/16, 127.0.0.1) a rule's webhook may reach although "
        "they are loopback, private, link-local or otherwise internal (refused by default)"))
    webhook_connections: int = Field(20, ge=1, le=1000, description="connections the webhook sender keeps "
                                     "open at once, all receivers together")
    webhook_queue: int = Field(1000, ge=1, description="alert changes waiting per receiver; past it "
                               "the newest are dropped (logged)")
    webhook_sends_per_event: int = Field(3, ge=1, description="posts one receiver host gets per event "
                                         "(one batch's alert changes); the rest are dropped (logged)")
    rules_per_user: int = Field(100, ge=1, description="alert rules one person may have; past it 409")
    channels_per_rule: int = Field(10, ge=0, le=1000, description="webhook channels one rule may have")
    rule_window_values: int = Field(50, ge=10, le=10_000, description="recent values a jump rule keeps per "
                                    "job (its mean and spread)")
    metric_names_per_job: int = Field(METRIC_NAMES_PER_JOB, ge=1, description="distinct metric names one job may log; "
                                      "past it the job gets one warning and further names are refused")
    alert_reopen_s: float = Field(20.0, ge=0, description="an alert raised again within this many seconds of "
                                  "its clear reopens the same alert; webhooks hold a clear this long")
    ws_queue_frames: int = Field(256, description="frames buffered per browser before coalescing")
    analyze_timeout_s: float = 300.0
    hub_check_timeout_s: float = Field(20.0, gt=0, description="a submit naming a Hub repo waits this long for "
                                       "the Hub, then 422 (other submits never wait on the Hub)")
    analysis_slots: int = Field(2, ge=1, le=16, description="dataset analyses (preflight, /api/datasets/analyze) "
                                "run at once; the rest wait")
    analyses_per_user: int = Field(2, ge=1, description="analyses one token may have running or waiting; "
                                   "past that 429 (a submit skips its analysis)")
    preflight_wait_s: float = Field(5.0, ge=0, description="a submit waits this long for the data analysis "
                                                            "behind its warnings (0: no analysis)")
    log_max_bytes: int = Field(64 * 1024 * 1024, ge=65536, description="each job's stored log is kept whole up to "
                               "this many bytes; past it its oldest lines are dropped")
    session_ttl_s: float = Field(7 * 86400.0, gt=0, description="a browser login lasts this long")

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'tokenpulse.db').resolve()}"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"
