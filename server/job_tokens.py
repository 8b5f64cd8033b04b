"""A job's own credential, for the processes a Slurm executor starts on the allocation's nodes
(worker/agent/slurm_node.py): minted at the executor's claim (`ClaimRequest.slurm`), shown once in
the Claim, stored hashed in jobs.report_hash. It acts as the agent that holds the job, for that job
alone (security.confine on every agent route), and only while that attempt is active: a new claim
replaces it, the attempt's end or the executor token's revocation makes it worthless (within the 5 s
of the token cache). The executor's own token never leaves the executor's machine."""
from __future__ import annotations

import secrets
from typing import Optional

from server import auth
from server.models import Agent, Job, Token
from server.security import Caller
from tokenpulse.protocol import ACTIVE_STATES, JobState

PREFIX = "tpj_"


def mint(job: Job) -> str:
    """A fresh credential for this attempt of the job (any earlier one stops working)."""
    token = f"{PREFIX}{job.id}_{job.attempt}_{secrets.token_urlsafe(24)}"
    job.report_hash = auth.hash_token(token)
    return token


def caller(db, token: str) -> Optional[Caller]:
    try:
        job_id, attempt = (int(x) for x in token[len(PREFIX):].split("_", 2)[:2])
    except ValueError:
        return None
    with db.read() as s:
        job = s.get(Job, job_id)
        if (job is None or job.report_hash is None or job.report_hash != auth.hash_token(token)
                or job.attempt != attempt or job.agent_id is None or JobState(job.state) not in ACTIVE_STATES):
            return None
        agent = s.get(Agent, job.agent_id)
        if agent is None or agent.token_id is None:
            return None
        executor = s.get(Token, agent.token_id)
        if executor is None or executor.revoked_at is not None:  # dies with the executor's token too
            return None
        return Caller(auth.AGENT, agent.token_id, frozenset(), job_id=job_id)
