"""The agent's rank logic on its own (worker/agent/ranks.py, gangwatch.py): grouping stacks and
naming the odd rank, the straggler rule, the verdict naming the rank that died. Pure logic: real
py-spy-shaped dumps and a real torchrun failure summary as input, the clock passed in."""
from __future__ import annotations

from tokenpulse.protocol import ExitVerdict
from worker.agent.gangwatch import GangState, judge, watch_deaths
from worker.agent.ranks import RankBoard, diagnose, torchrun_failures

SITE = "/venv/lib/python3.11/site-packages/torch/distributed"


def dump(pid: int, *frames: str) -> str:
    return f"Process {pid}: python -m worker.training.train\nPython v3.11\n\nThread {pid} (idle): \"MainThread\"\n" + \
        "".join(f"    {f}\n" for f in frames) + \
        "\nThread 99 (idle): \"tokenpulse-alive\"\n    _alive_loop (/w/emit.py:160)\n"


def board(n: int) -> RankBoard:
    b = RankBoard()
    for r in range(n):
        b.observe(r, "info", {"rank": r, "host": "h", "pid": 100 + r, "device": "cpu"}, 0.0)
    return b


WAITING = ("all_reduce (%s/distributed_c10d.py:3252)" % SITE, "wrapper (%s/c10d_logger.py:81)" % SITE,
           "agree (/w/worker/training/distributed.py:111)", "run (/w/worker/training/loop.py:145)")


def test_the_rank_not_in_a_collective_is_named_and_the_waiting_ones_grouped():
    stacks = {0: dump(100, *WAITING), 1: dump(101, "_fault_hang (/w/worker/training/faults.py:60)",
                                             "at (/w/worker/training/faults.py:90)",
                                              "run (/w/worker/training/loop.py:142)"),
              2: dump(102, *WAITING), 3: dump(103, *WAITING)}
    msg = diagnose(stacks, board(4))
    assert msg.startswith("rank 1 (h, pid 101) at _fault_hang (/w/worker/training/faults.py:60); "), msg
    assert ("ranks 0, 2, 3 waiting in all_reduce at agree (/w/worker/training/distributed.py:111) "
            "< run (/w/worker/training/loop.py:145)") in msg


def test_ranks_in_the_ddp_backward_wait_too():
    backward = ("_engine_run_backward (/venv/lib/python3.11/site-packages/torch/autograd/graph.py:829)",
                "backward (/venv/lib/python3.11/site-packages/torch/_tensor.py:625)",
                "run (/w/worker/training/loop.py:170)")
    stacks = {0: dump(100, *backward), 1: dump(101, "load (/w/data.py:88)", "run (/w/worker/training/loop.py:152)")}
    msg = diagnose(stacks, board(2))
    assert msg.startswith("rank 1 (h, pid 101) at load (/w/data.py:88)"), msg
    assert ("rank 0 (h, pid 100) waiting in all_reduce (DDP gradients, in backward) "
            "at run (/w/worker/training/loop.py:170)") in msg


def test_all_ranks_at_one_place_is_said_so():
    msg = diagnose({0: dump(100, *WAITING), 1: dump(101, *WAITING)}, board(2))
    assert msg.startswith("every rank at the same place: "), msg


def test_a_straggler_is_named_once_and_cleared():
    b = board(3)
    for r, busy in ((0, 0.1), (1, 0.1), (2, 0.9)):
        b.observe(r, "alive", {"step": 5, "busy_s": busy, "step_time_s": 1.0}, 1.0)
    kind, msg = b.check_straggler()
    assert kind == "straggler" and msg.startswith("straggler: rank 2 (h, pid 102) works 0.90 s per step against 0.10 "
                                                  "s"), msg
    assert b.check_straggler() is None  # not again while it lasts
    for k in range(3):  # judged on the median of each rank's last reports: one fast step is not enough
        b.observe(2, "alive", {"step": 6 + k, "busy_s": 0.12}, 2.0 + k)
    assert b.check_straggler() == ("straggler_clear", "the ranks keep pace with each other again (rank 2 was slowest)")


SUMMARY = """[ERROR] failed (exitcode: 1) local_rank: 0 (pid: 100) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
worker.training.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_08:20:01
  host      : h
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 101)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 101
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_08:20:01
  host      : h
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 100)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_the_rank_that_died_silently_is_blamed_not_the_peer_that_echoed_it():
    assert torchrun_failures(SUMMARY.splitlines()) == {1: (-9, 101), 0: (1, 100)}
    g = GangState(board=board(2))
    g.observe(0, "state", {"state": "failed", "failure": "crash", "reason": "RuntimeError: Connection reset by peer"},
              5.0, 5.0)
    v = judge(g, ExitVerdict(state="failed", failure="crash", exit_code=1), SUMMARY.splitlines())
    assert v.signal == "SIGKILL" and v.retry and v.failure == "signal"
    assert v.reason.startswith("rank 1 (h, pid 101) killed by SIGKILL; the gang was stopped; then rank 0: "
                               "RuntimeError"), v


def test_a_rank_gone_without_finishing_starts_the_teardown_one_that_finished_does_not():
    g = GangState(board=board(2))
    assert watch_deaths(g, [100, 101], 0.0) is None
    g.observe(1, "state", {"state": "completed"}, 1.0, 1.0)
    assert watch_deaths(g, [100], 1.0) is None and watch_deaths(g, [100], 2.0) is None  # finished: fine
    g = GangState(board=board(2))
    watch_deaths(g, [100, 101], 0.0)
    assert watch_deaths(g, [100], 1.0) is None  # its last words may still be in the pipe
    line = watch_deaths(g, [100], 1.6)
    assert line.startswith("rank 1 (h, pid 101) ended without reporting") and g.down_at == 1.6 and g.died_rank == 1
