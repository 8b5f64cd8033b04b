"""The agent protocol: register, heartbeat, claim, report events. Agent tokens only."""
from __future__ import annotations

import json
import time
from typing import Optional

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy import select

from server import auth, gang, job_tokens, ranks, store
from server.agent_protocol import Incoming, after_ingest, apply_messages
from server.context import AppDep
from server.hub import job_frames
from server.ingest import parse
from server.models import Agent, Job
from server.schemas import AgentOut
from server.security import AgentDep, UserDep, confine, no_job_credential
from tokenpulse.protocol import (
    AGENTS_TOPIC,
    COMMAND,
    AgentHello,
    AgentReply,
    Claim,
    ClaimRequest,
    Heartbeat,
    MachineSample,
    agent_frame,
    load_spec,
)

router = APIRouter(prefix="/api/agents", tags=["agents"])


def agent_dict(a: Agent, job_ids: list[int], system: Optional[dict] = None) -> dict:
    return {"system": system, "id": a.id, "name": a.name, "host": a.host, "device": a.device, "capacity": a.capacity,
            "accepts_commands": bool(a.accepts_commands), "state": a.state, "created_at": a.created_at,
            "seen_at": a.seen_at, "jobs": job_ids}


@router.post("", status_code=201)
async def register(hello: AgentHello, tp: AppDep, caller: AgentDep) -> AgentOut:
    """An agent says who it is. `accepts_commands` (started with --allow-commands) needs a token an
    admin created for commands: a command job hands its argv, env and cwd to the agent that takes it."""
    no_job_credential(caller, "register an agent")
    if hello.accepts_commands and auth.COMMANDS not in caller.scopes:
        raise HTTPException(403, "accepts_commands refused: this agent token was not created for command jobs. "
                                 "Start the agent without --allow-commands, or have an admin create a token with "
                                 "`tokenpulse tokens create NAME --role agent --allow-commands`")

    def add(s):
        now = time.time()
        # A restart (same token, same work dir on the same host) keeps the agent's identity: the jobs
        # the old process held are settled by reconcile like any job the agent no longer reports.
        a = s.scalar(select(Agent).where(Agent.token_id == caller.token_id, Agent.instance == hello.instance)
                     .order_by(Agent.id.desc()).limit(1)) if hello.instance else None
        if a is None:
            a = Agent(created_at=now, token_id=caller.token_id, instance=hello.instance)
            s.add(a)
        a.name, a.host, a.device, a.capacity = hello.name, hello.host, hello.device, hello.capacity
        a.accepts_commands, a.state, a.seen_at = hello.accepts_commands, "online", now
        s.flush()
        return agent_dict(a, [])
    d = await tp.db.write(add)
    tp.hub.publish(AGENTS_TOPIC, agent_frame(d), False)
    return d


@router.get("")
def list_agents(tp: AppDep, _: UserDep) -> list[AgentOut]:
    with tp.db.read() as s:
        running: dict[int, list[int]] = {}
        for jid, aid in s.execute(select(Job.id, Job.agent_id).where(Job.agent_id.is_not(None))):
            running.setdefault(aid, []).append(jid)
        return [agent_dict(a, running.get(a.id, []), json.loads(a.machine) if a.machine and a.state == "online"
                           else None)
                for a in s.scalars(select(Agent).order_by(Agent.id))]


def known_agent(s, agent_id: int, caller=None) -> Agent:
    agent = s.get(Agent, agent_id)
    if agent is None:
        raise HTTPException(404, f"agent {agent_id} is not registered")
    if caller is not None and agent.token_id is not None and agent.token_id != caller.token_id:
        raise HTTPException(403, f"agent {agent_id} was registered with another token; "
                                 "an agent token acts only for the agents it registered")
    return agent


@router.post("/{agent_id}/heartbeat")
async def heartbeat(agent_id: int, hb: Heartbeat, tp: AppDep, caller: AgentDep) -> AgentReply:
    """The agent and the jobs it names are alive (a distributed job's rank rows with them); answered
    with the commands waiting for it. Applied as a websocket heartbeat is (server/agent_protocol.py).
    A job's own credential (a Slurm node process) beats for its job alone."""
    confine(caller, [*hb.jobs, *hb.ranks, *hb.held])

    def beat(s):
        known_agent(s, agent_id, caller)
        return apply_messages(s, tp, [Incoming(agent_id, heartbeat=hb, job_only=caller.job_id)])
    with tp.arriving.held(None if caller.job_id is not None else agent_id):
        applied = await tp.db.write(beat)
    after_ingest(tp, applied.outcome)
    return applied.replies[0]


@router.post("/{agent_id}/system", status_code=204)
async def machine_sample(agent_id: int, sample: MachineSample, tp: AppDep, caller: AgentDep) -> Response:
    """The agent's machine now (CPU, memory, network, GPUs), every few seconds: its latest sample kept on
    the agent's row for the workers page (the jobs' own sys/ series are stored as metrics)."""
    no_job_credential(caller, "report the machine")
    body = sample.model_dump_json()

    def keep(s):
        known_agent(s, agent_id, caller).machine = body
    await tp.db.write(keep)
    return Response(status_code=204)


@router.post("/{agent_id}/claim", responses={204: {"description": "no job for this agent now"},
                                             202: {"description": "gathering a multi-node job's gang: claim again"}})
async def claim(agent_id: int, tp: AppDep, caller: AgentDep, offer: Optional[ClaimRequest] = None):
    """The best queued job for this agent. A Slurm executor (offer.slurm) takes a multi-node job
    whole (Slurm allocates its nodes; its token needs `gang`) and gets the job's own credential for
    the node processes it starts (Claim.job_token)."""
    no_job_credential(caller, "claim jobs")
    slurm = offer is not None and offer.slurm

    def take(s):
        agent = known_agent(s, agent_id, caller)
        agent.seen_at, agent.state = time.time(), "online"
        token = None
        if not slurm:
            got = gang.claim(s, agent, offer.endpoint if offer else None, tp.settings.gang_timeout_s,
                             trusted=auth.GANG in caller.scopes)
            if isinstance(got, gang.Waiting):
                return got
            if got is not None:
                return got.job, store.job_summary(got.job), got, None
        job = store.claim(s, agent_id, whole_gangs=slurm and auth.GANG in caller.scopes)
        if job is None:
            return None
        if slurm:
            token = job_tokens.mint(job)
        return job, store.job_summary(job), None, token
    got = await tp.db.write(take)
    if got is None:
        return Response(status_code=204)
    if isinstance(got, gang.Waiting):
        return JSONResponse({"gathering": got.job_id, "members": got.members, "nnodes": got.nnodes}, status_code=202)
    job, summary, share, token = got
    tp.hub.publish_all(job_frames(summary))
    return Claim(job_id=job.id, attempt=job.attempt, seq_start=job.next_seq, kind=job.kind,
                 spec=load_spec(job.kind, job.spec), resume_from=job.checkpoint,
                 node_rank=share.node_rank if share else 0, rdzv_endpoint=share.endpoint if share else None,
                 path_roots=[str(r) for r in tp.settings.path_roots] if job.kind == COMMAND else [],
                 job_token=token)


@router.get("/{agent_id}/jobs/{job_id}")
def held_job(agent_id: int, job_id: int, tp: AppDep, caller: AgentDep) -> dict:
    """Where a job this agent holds stands now: its attempt, state, the next event seq the server
    expects and, while active, its claim afresh. A Slurm executor asks after a restart and before it
    reports for a job its node process reported for; the node process asks at its start."""
    confine(caller, [job_id])
    with tp.db.read() as s:
        known_agent(s, agent_id, caller)
        job = s.get(Job, job_id)
        if job is None:
            raise HTTPException(404, f"job {job_id} does not exist")
        held = job.agent_id == agent_id and job.state in ("starting", "running")
        claim = Claim(job_id=job.id, attempt=job.attempt, seq_start=job.next_seq, kind=job.kind,
                      spec=load_spec(job.kind, job.spec), resume_from=job.checkpoint,
                      path_roots=[str(r) for r in tp.settings.path_roots] if job.kind == COMMAND else []
                      ) if held else None
        return {"job_id": job.id, "attempt": job.attempt, "state": job.state, "held": held,
                "next_seq": job.next_seq, "claim": claim.model_dump(mode="json") if claim else None}


def lead_job(s, agent_id: int, job_id: int, caller) -> Job:
    known_agent(s, agent_id, caller)
    job = s.get(Job, job_id)
    if job is None or job.agent_id != agent_id:
        raise HTTPException(404, f"job {job_id} is not run by agent {agent_id}")
    return job


@router.post("/{agent_id}/jobs/{job_id}/stacks", status_code=202)
async def ask_gang_stacks(agent_id: int, job_id: int, tp: AppDep, caller: AgentDep) -> dict:
    """Node rank 0's agent on a multi-node stall: the other nodes' agents are asked (their next
    heartbeat reply) for their ranks' stacks."""
    confine(caller, [job_id])

    def ask(s):
        job = lead_job(s, agent_id, job_id, caller)
        if caller.job_id is not None:  # a Slurm job's node rank 0: its other nodes are no gang members
            return ranks.ask_other_nodes(s, job, load_spec(job.kind, job.spec).nproc_per_node)
        return gang.request_stacks(s, job)
    asked = await tp.db.write(ask)
    return {"asked": asked}


@router.get("/{agent_id}/jobs/{job_id}/stacks")
def gang_stacks(agent_id: int, job_id: int, tp: AppDep, caller: AgentDep) -> list[dict]:
    """The stacks the other nodes' agents sent for their ranks since the ask (heartbeats), for node
    rank 0's agent to name the stuck rank across the gang in one verdict."""
    confine(caller, [job_id])
    with tp.db.read() as s:
        lead_job(s, agent_id, job_id, caller)
        return ranks.stacks(s, job_id)


@router.post("/{agent_id}/events", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object", "required": ["events"],
                                    "properties": {"events": {"type": "array", "items": {"type": "object"}}}}}}}})
async def report(agent_id: int, request: Request, tp: AppDep, caller: AgentDep) -> AgentReply:
    """Store a batch of events (an EventBatch: {"events": [...]}) in one transaction; answer with the
    highest stored seq per job (the agent drops those from its journal) and any commands for its jobs."""
    # Raw bytes in, parsed and checked on the writer thread (ingest/parse.py: a fast path for
    # metric events, the protocol model for the rest): 5,000 events through pydantic here would hold
    # the event loop, and every websocket with it, for ~75 ms.
    body = await request.body()

    def store_batch(s):
        known_agent(s, agent_id, caller)
        events = parse.parse_batch(body)
        confine(caller, {e.job_id for e in events})
        return apply_messages(s, tp, [Incoming(agent_id, events=events, job_only=caller.job_id)])
    with tp.arriving.held(None if caller.job_id is not None else agent_id):
        applied = await tp.db.write(store_batch, bulk=len(body) > 65536)  # big batches: the bulk lane
    after_ingest(tp, applied.outcome)
    return applied.replies[0]
