"""Pure logic of the stall and slow detectors, with a fake clock: no processes, no waiting."""
from __future__ import annotations

import pytest

from tokenpulse.diagnosis.stall import StallConfig, StallDetector
from tokenpulse.protocol import JobSpec, StallSpec
from worker.agent.slow import SlowDetector

# No alert hysteresis here: these tests judge each rule at once (tests/test_alert_trust.py judges the hysteresis)
CFG = StallConfig(factor=5, floor_s=3, ceiling_s=100, first_step_s=20, phase_s=40, alert_open_s=0, alert_clear_s=0)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float) -> float:
        self.t += dt
        return self.t


def train_steps(d: StallDetector, clock: Clock, n: int, dt: float, start: int = 0):
    """What the training loop sends per logged step: metrics, then the training phase counter."""
    for k in range(start + 1, start + n + 1):
        clock.tick(dt)
        d.observe("metrics", {"step": k, "values": {"loss": 1.0}}, clock())
        d.observe("phase", {"name": "training", "done": k, "total": 1000, "unit": "steps"}, clock())


def started(cfg=CFG) -> tuple[StallDetector, Clock]:
    c = Clock()
    d = StallDetector(cfg)
    d.start(c())
    return d, c


# ---- stalled ----------------------------------------------------------------------------------

def test_alive_is_not_progress():
    d, c = started()
    d.observe("phase", {"name": "loading model"}, c())
    for _ in range(60):  # the alive thread keeps talking; nothing moves
        c.tick(1)
        d.observe("alive", {"phase": "loading model"}, c())
        if d.check(c()):
            break
    assert d.stalled and c() - 1000 == pytest.approx(41)  # phase_s budget (no counter), not earlier


def test_learned_timeout_from_step_history():
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 1000, "unit": "steps"}, c())
    train_steps(d, c, 10, 0.2)
    assert d.timeout() == 3  # 5 x 0.2 s = 1 s, raised to the floor
    c.tick(2.9)
    assert d.check(c()) is None
    c.tick(0.2)
    v = d.check(c())
    assert v is not None and v.kind == "stalled" and "training" in v.message and "at 10/1000 steps" in v.message
    assert d.check(c.tick(5)) is None  # said once
    train_steps(d, c, 0, 0)
    r = d.observe("metrics", {"step": 11, "values": {}}, c.tick(1))
    assert r is not None and r.kind == "recovered" and not d.stalled


def test_metrics_and_phase_of_the_same_step_count_once():
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c())
    train_steps(d, c, 6, 10.0)
    hist = list(d.intervals["training"])
    assert hist and all(x == pytest.approx(10.0) for x in hist)  # no ~0 s interval from the phase echo
    assert d.timeout() == 50


def test_slow_steps_scale_the_timeout_and_ceiling_caps_it():
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c())
    train_steps(d, c, 6, 30.0)
    assert d.timeout() == 100  # 5 x 30 = 150, capped at the ceiling
    c.tick(99)
    assert d.check(c()) is None
    assert d.check(c.tick(2)).kind == "stalled"


def test_first_step_allowance():
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c())
    assert d.timeout() == 20  # no history: first_step_s, not the floor
    c.tick(19)
    assert d.check(c()) is None
    assert d.check(c.tick(2)).kind == "stalled"


def test_a_stopped_process_is_stalled_at_the_floor_before_any_interval_is_learned():
    """Issue 19's last miss: a fast loop SIGSTOPped in its first seconds had no step interval yet,
    so the first-step allowance applied. A stopped process cannot move: the floor applies."""
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c())
    d.observe_stopped(True, c.tick(1))
    assert d.timeout() == d.config.floor_s < d.config.first_step_s
    v = d.check(c.tick(d.config.floor_s))
    assert v is not None and v.kind == "stalled" and "the process is stopped" in v.message, v
    d2, c2 = started()
    d2.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c2())
    d2.observe_stopped(True, c2.tick(1))
    d2.observe_stopped(False, c2.tick(1))  # continued: the first-step allowance again
    assert d2.timeout() == d2.config.first_step_s
    assert d2.check(c2.tick(d2.config.floor_s)) is None


def test_slow_phase_reporting_progress_never_stalls():
    d, c = started()
    d.observe("phase", {"name": "loading dataset", "detail": "stream"}, c())
    el = 0.0
    for _ in range(int(60 / 0.5)):  # 60 s phase = 20x the floor, progress every 0.5 s
        el += 0.5
        c.tick(0.5)
        d.observe("phase", {"name": "loading dataset", "done": el, "total": 60, "unit": "s"}, c())
        for _ in range(2):
            c.tick(0.0)
            assert d.check(c()) is None
    assert not d.stalled


def test_streaming_detail_counts_as_progress():
    d, c = started()
    d.observe("phase", {"name": "accumulating", "detail": "0 samples"}, c())
    for k in range(1, 30):
        c.tick(2.5)
        d.observe("phase", {"name": "accumulating", "detail": f"{k * 100} samples"}, c())
        assert d.check(c()) is None


def test_returning_to_a_phase_keeps_its_history():
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c())
    train_steps(d, c, 6, 1.0)
    d.observe("phase", {"name": "saving", "detail": "checkpoint at step 6"}, c.tick(0.1))
    # saving reports no counter and has no history: judged by the job's learned step interval
    assert d.timeout() == 5 and "job's typical 1.00 s per step" in d.explain_timeout()
    c.tick(4)
    assert d.check(c()) is None
    d.observe("phase", {"name": "training", "done": 6, "total": 100, "unit": "steps"}, c())
    assert d.timeout() == 5  # training's learned timeout, not the first-step allowance again
    assert d.check(c.tick(6)).kind == "stalled"


def test_silent_process_is_named():
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c())
    train_steps(d, c, 6, 1.0)
    v = d.check(c.tick(30))
    assert "alive thread is silent" in v.message
    d2, c2 = started()
    d2.observe("phase", {"name": "training", "done": 0, "total": 100, "unit": "steps"}, c2())
    train_steps(d2, c2, 6, 1.0)
    for _ in range(10):
        d2.observe("alive", {}, c2.tick(1))
    assert "is alive" in d2.check(c2()).message


def test_config_from_env_and_per_job_spec():
    cfg = StallConfig.from_env({"TOKENPULSE_STALL_FLOOR_S": "45", "TOKENPULSE_STALL_FACTOR": "7",
                                "TOKENPULSE_STALL_MIN_INTERVALS": "4"})
    assert (cfg.floor_s, cfg.factor, cfg.min_intervals, cfg.ceiling_s) == (45, 7, 4, 1800)
    spec = JobSpec(stall=StallSpec(floor_s=3, slow_factor=2.5))
    job = cfg.merged(spec.stall.model_dump())
    assert (job.floor_s, job.factor, job.slow_factor) == (3, 7, 2.5)
    with pytest.raises(ValueError):
        StallConfig.from_env({"TOKENPULSE_STALL_FLOOR_S": "soon"})


# ---- slow -------------------------------------------------------------------------------------

def feed(s: SlowDetector, c: Clock, steps, st: float, tps: float, pad: float = 0.05, start_step=None):
    step = start_step if start_step is not None else (s.last_step or 2)
    for _ in range(steps):
        c.tick(st)
        step += 1
        s.observe("metrics", {"step": step, "values": {"loss": 1.0, "step_time_s": st, "tokens_per_s": tps,
                                                       "padding_frac": pad}}, c())
    return s.check(c())


def test_throughput_drop_is_slow_and_clears():
    s, c = SlowDetector(CFG), Clock()
    assert feed(s, c, 10, 0.1, 5000) is None
    v = feed(s, c, 3, 0.5, 1000)
    assert v is not None and v.kind == "slow" and "fell 5.0x" in v.message and "5,000 tokens/s" in v.message
    assert feed(s, c, 3, 0.5, 1000) is None  # same reasons: not raised again
    v = feed(s, c, 3, 0.1, 5000)
    assert v is not None and v.kind == "slow_clear"


def test_noise_is_not_slow():
    import random
    rnd = random.Random(1)
    s, c = SlowDetector(CFG), Clock()
    for _ in range(300):
        st = 0.1 * rnd.uniform(0.6, 1.8)
        assert feed(s, c, 1, st, 500 / st) is None


def test_below_preflight_projection():
    s, c = SlowDetector(CFG), Clock()
    s.observe("info", {"batch_size": 4, "measured": [{"rows": 2, "tokens_per_s": 900.0},
                                                     {"rows": 4, "tokens_per_s": 10000.0}]}, c())
    v = feed(s, c, 5, 1.0, 1500)
    assert v.kind == "slow" and "preflight projection of 10,000 tokens/s" in v.message


def test_padding_waste_names_recommended_length():
    s, c = SlowDetector(CFG), Clock()
    s.observe("info", {"padding": "max_length", "reason": "asked for"}, c())
    s.observe("info", {"max_seq_length": 2048, "recommended_max_seq_length": 136}, c())
    v = feed(s, c, 4, 0.5, 200, pad=0.95)
    assert v.kind == "slow" and "95% of every batch is pad tokens" in v.message
    assert "max_seq_length=136" in v.message and "padding=max_length" in v.message


def test_padding_waste_estimates_a_length_without_info():
    s, c = SlowDetector(CFG), Clock()
    s.observe("info", {"padding": "max_length", "max_seq_length": 1024}, c())
    v = feed(s, c, 4, 0.5, 200, pad=0.9)
    assert "max_seq_length around 208" in v.message  # 2 x (0.1 x 1024) rounded up to 8


def test_cpu_while_gpu_and_fp32_on_bf16_gpu():
    s, c = SlowDetector(CFG, gpu="NVIDIA H100", gpu_bf16=True), Clock()
    s.observe("info", {"device": "cpu", "reason": "asked for cpu"}, c())
    v = feed(s, c, 4, 0.5, 200)
    assert v.kind == "slow" and "on the CPU although this worker has a GPU (NVIDIA H100)" in v.message
    s2 = SlowDetector(CFG, gpu="NVIDIA H100", gpu_bf16=True)
    s2.observe("info", {"device": "cuda"}, c())
    s2.observe("info", {"precision": "fp32", "reason": "asked for"}, c())
    v = feed(s2, c, 4, 0.5, 200)
    assert "fp32 on a GPU with bf16" in v.message
    s3 = SlowDetector(CFG, gpu=None)
    s3.observe("info", {"device": "cpu"}, c())
    assert feed(s3, c, 4, 0.5, 200) is None  # a CPU-only worker: nothing to name


def test_crawling_steps_name_the_batch():
    s, c = SlowDetector(StallConfig(slow_step_s=60, alert_open_s=0)), Clock()
    s.observe("info", {"batch_size": 64, "row_len": 4096}, c())
    s.observe("info", {"grad_accum": 32}, c())
    v = feed(s, c, 3, 90.0, 100)
    assert "each optimizer step takes 90 s (64 rows x 32 accumulation x 4096 tokens)" in v.message


def test_steady_growth_vs_one_jump():
    s, c = SlowDetector(CFG), Clock()
    st, v = 0.1, None
    for _ in range(14):
        st *= 1.1
        v = feed(s, c, 1, st, 100 / st) or v
    assert v is not None and "grows steadily" in v.message
    j, c = SlowDetector(StallConfig(slow_factor=100)), Clock()
    for k in range(14):
        st = 0.1 if k < 7 else 0.3
        assert feed(j, c, 1, st, 100 / st) is None  # a 3x jump is not growth (and under this slow_factor)


def test_periodic_stalls_every_n_steps():
    s, c = SlowDetector(CFG), Clock()
    step = 2
    v = None
    for _ in range(60):
        step += 1
        dt = 0.1
        if step % 10 == 0:
            s.observe("phase", {"name": "evaluating"}, c())
            dt = 1.5
        c.tick(dt)
        s.observe("metrics", {"step": step, "values": {"step_time_s": 0.1, "tokens_per_s": 1000}}, c())
        v = s.check(c()) or v
    assert v is not None and "periodic stalls every 10 steps" in v.message and "evaluating" in v.message


def test_stuck_at_reads_both_dump_formats():
    from tokenpulse.diagnosis.stall import stuck_at
    spy = ('py-spy dump:\nProcess 1: python\n\nThread 14747 (idle): "MainThread"\n'
           '    _fault_hang (worker/controls.py:41)\n    Faults.before_step (worker/controls.py:57)\n'
           'Thread 14752 (idle): "tokenpulse-alive"\n    Condition.wait (threading.py:331)\n')
    assert stuck_at(spy) == "_fault_hang (worker/controls.py:41)"
    fh = ('faulthandler dump:\nThread 0x00007f35e9a3b6c0 (most recent call first):\n'
          '  File "/x/threading.py", line 331 in wait\n\n'
          'Current thread 0x00007f35eba31b80 (most recent call first):\n'
          '  File "/work/main/worker/controls.py", line 41 in _fault_hang\n')
    assert stuck_at(fh) == "_fault_hang (/work/main/worker/controls.py:41)"
    assert stuck_at(None) is None and stuck_at("garbage") is None


def test_busy_machine_bursts_below_the_factor_are_not_slow():
    s, c = SlowDetector(StallConfig()), Clock()  # default slow_factor (4)
    assert feed(s, c, 30, 0.1, 5000) is None
    assert feed(s, c, 10, 0.35, 5000 / 3.5) is None  # a neighbour takes the CPU: 3.5x, under 4x
    assert feed(s, c, 20, 0.1, 5000) is None
    assert feed(s, c, 5, 0.6, 5000 / 6) is None  # held 3 s: not yet past the default alert_open_s (10 s)
    v = feed(s, c, 20, 0.6, 5000 / 6)
    assert v.kind == "slow" and "fell" in v.message
    assert feed(s, c, 30, 0.6, 5000 / 6) is None  # a long slow stretch stays slow (baseline frozen)
    assert s.open_keys == {"fell"}


def feed_sched(s: SlowDetector, c: Clock, steps: int, st: float, run_share: float, wait_share: float, acc):
    """Steps of st seconds; the process ran run_share of the wall time and waited for a CPU wait_share."""
    for _ in range(steps):
        for _ in range(4):
            c.tick(st / 4)
            acc[0] += run_share * st / 4
            acc[1] += wait_share * st / 4
            s.machine.observe_sched(c(), acc[0], acc[1])
        step = (s.last_step or 2) + 1
        s.observe("metrics", {"step": step, "values": {"step_time_s": st, "tokens_per_s": 100 / st}}, c())
    return s.check(c()), s.check_contention()


def test_cpu_starvation_is_contention_not_slow_and_a_sleep_is_slow():
    s, c, acc = SlowDetector(CFG), Clock(), [0.0, 0.0]
    assert feed_sched(s, c, 12, 1.0, 0.95, 0.02, acc) == (None, None)
    s.machine.observe_load(7.7, 2)
    slow, cont = feed_sched(s, c, 5, 5.0, 0.2, 0.8, acc)  # runnable all along, on a CPU 20% of it
    assert slow is None and cont.kind == "contention"
    assert "waited for a CPU 80% of the time" in cont.message and "load 7.7 on 2 cores" in cont.message
    slow, cont = feed_sched(s, c, 6, 1.0, 0.95, 0.02, acc)
    assert slow is None and cont.kind == "contention_clear"

    s, c, acc = SlowDetector(CFG), Clock(), [0.0, 0.0]
    feed_sched(s, c, 12, 1.0, 0.95, 0.02, acc)
    slow, cont = feed_sched(s, c, 5, 5.0, 0.2, 0.01, acc)  # 5x slower, sleeping (not waiting): slow
    assert slow.kind == "slow" and "fell 5.0x" in slow.message and cont is None


def test_steps_on_alive_events_are_progress_between_metric_points():
    d, c = started()
    d.observe("phase", {"name": "training", "done": 0, "total": 1000, "unit": "steps"}, c())
    for k in range(1, 200):  # log_every=50 and 2 s steps: metrics every 100 s, alive carries the step
        c.tick(2)
        d.observe("alive", {"phase": "training", "step": k}, c())
        if k % 50 == 0:
            d.observe("metrics", {"step": k, "values": {"loss": 1.0}}, c())
        assert d.check(c()) is None
    assert d.timeout() == 10  # learned from the steps, not from the 100 s between metric points
    d.observe("alive", {"phase": "training", "step": 199}, c.tick(5))
    assert d.check(c.tick(6)).kind == "stalled"


def test_a_completed_counter_gets_the_between_phases_budget():
    d, c = started()
    for k in range(0, 11):  # tokenizing at 0.2 s a batch, then done: next comes unreported work
        d.observe("phase", {"name": "tokenizing", "done": k * 100, "total": 1000, "unit": "examples"}, c.tick(0.2))
    assert d.finished() and d.timeout() == 40  # phase_s, not 5 x 0.2 s
    assert d.check(c.tick(39)) is None
    v = d.check(c.tick(2))
    assert v.kind == "stalled" and "between phases" in v.message


def test_memory_stays_bounded_over_a_long_job():
    s, c = SlowDetector(CFG), Clock()
    for k in range(3, 20_000):
        if k % 100 == 0:
            s.observe("phase", {"name": "saving"}, c())
        s.observe("metrics", {"step": k, "values": {"step_time_s": 0.1, "tokens_per_s": 1000}}, c.tick(0.1))
    assert len(s.arrivals) <= 2000 and len(s.samples) <= 2000 and len(s.pauses_at) <= 25


def test_stuck_at_finds_the_main_thread_by_pid_when_unnamed():
    from tokenpulse.diagnosis.stall import stuck_at
    spy = ('py-spy dump (--nonblocking; process 7349 state: T (stopped)):\nProcess 7349: python -c\n\n'
           'Thread 7360 (idle)\n    wait (/x/threading.py:331)\nThread 7349 (idle)\n    stuck (/x/a.py:4)\n')
    assert stuck_at(spy) == "stuck (/x/a.py:4)"


def test_step_interval_learned_from_the_alive_step_counter():
    """A plain loop's steps arrive at most once a second (alive, a rate-limited phase): one report
    covering 13 steps is 13 steps of history, so a hang at step 15 is judged by the floor, not by
    a first-step allowance of minutes (fault benchmark: deadlock in a plain loop)."""
    cfg = StallConfig(floor_s=30, alert_open_s=0, alert_clear_s=0)  # the defaults a user gets
    d, c = started(cfg)
    d.observe("phase", {"name": "training", "done": 1, "unit": "steps"}, c.tick(2))
    d.observe("alive", {"step": 14}, c.tick(0.9))  # the first report after entry: 13 steady steps
    assert d.timeout() == 30 and "13 steps" in d.explain_timeout()
    for _ in range(29):
        d.observe("alive", {"step": 14}, c.tick(1))
        assert d.check(c()) is None
    v = d.check(c.tick(1.5))
    assert v is not None and v.kind == "stalled" and "training steps" in v.message


def test_a_new_phase_after_steps_is_judged_by_the_step_interval():
    """An evaluation that never ends (its first batch hangs) after steps were learned: the job's
    step timeout, not the 600 s first-step allowance; before any steps the allowance holds."""
    cfg = StallConfig(alert_open_s=0, alert_clear_s=0)
    d, c = started(cfg)
    d.observe("phase", {"name": "evaluating", "done": 0, "unit": "batches"}, c())
    assert d.timeout() == cfg.first_step_s
    d.observe("phase", {"name": "training", "done": 1, "unit": "steps"}, c.tick(1))
    for k in range(2, 40):
        d.observe("alive", {"step": k}, c.tick(1))
    d.observe("phase", {"name": "evaluating", "done": 0, "unit": "batches"}, c.tick(1))
    assert d.timeout() == cfg.floor_s
    assert d.check(c.tick(cfg.floor_s + 1)).kind == "stalled"


def test_memory_blowup_from_the_agents_memory_readings():
    """A job whose memory grows 64 MiB a step (fault benchmark: memory) gets a memory verdict from the
    agent's own RSS readings, before the Trainer's few speed samples would allow any slow reason."""
    s = SlowDetector(CFG)
    for k, mb in enumerate([120, 300, 310, 305]):  # imports, then a steady job
        s.observe_memory(1000 + 5 * k, mb)
    assert s.reasons() == []
    for k, mb in enumerate([1500, 2900, 4100]):
        s.observe_memory(1020 + 5 * k, mb)
    (key, text), = s.reasons()
    assert key == "memory" and "memory blow-up" in text and "from 300 MiB to 4,100 MiB" in text
    v = s.check(1040)
    assert v is not None and v.kind == "slow" and "memory blow-up" in v.message


def test_a_memory_blowup_opens_on_two_samples_not_the_general_hold():
    """The general hold (alert_open_s, 10 s by default) on top of the 5 s samples took a blow-up
    growing 128 MiB/s past the fault benchmark's 35 s goal; two samples that agree are enough."""
    s = SlowDetector(StallConfig(alert_open_s=10, alert_clear_s=10))
    for k, mb in enumerate([120, 300, 310, 305, 1500]):
        s.observe_memory(1000 + 5 * k, mb)
    assert s.check(1020) is None  # seen once: held 0 s
    s.observe_memory(1025, 2900)
    v = s.check(1025)
    assert v is not None and "memory blow-up" in v.message  # held 5 s, not 10


def test_memory_that_grows_within_the_first_step_is_the_working_set_not_a_blowup():
    """Post-mortem case b: 8 DataLoader workers and the first step's activations took the job from
    443 MiB to 9 GiB during its first step, then memory held: no leak, no memory verdict. Growth
    across steps still is one."""
    s = SlowDetector(CFG)
    for k, (mb, step) in enumerate([(120, None), (443, 0), (2000, 0), (6000, 0), (9041, 1), (9050, 2)]):
        s.observe_memory(1000 + 5 * k, mb, step)
    assert s.reasons() == []
    for k, (mb, step) in enumerate([(300, 1), (310, 5), (1500, 20), (4100, 40)]):
        s.observe_memory(2000 + 5 * k, mb, step)
    (key, text), = s.reasons()
    assert key == "memory" and "from 300 MiB to 4,100 MiB" in text


def test_a_memory_blowup_of_a_distributed_job_names_the_rank_that_grows():
    s = SlowDetector(CFG)
    for k in range(8):
        t = 1000 + 5 * k
        s.observe("metrics", {"step": 10 * (k + 1), "values": {
            "anatomy/r0/rss_mb": 500.0, "anatomy/r1/rss_mb": 500.0 + 600 * k}}, t)
        s.observe_memory(t, 1000.0 + 600 * k, 10 * (k + 1))
    (key, text), = [r for r in s.reasons() if r[0] == "memory"]
    assert "rank 1 (500 -> 4,700 MiB)" in text, text


def test_samples_without_a_token_count_before_ones_with_it_do_not_break_the_judge():
    """A distributed job's first samples carried a step time but no tokens/s, the later ones both:
    the throughput median sorted None against floats and every detection pass raised (no stall
    alert could follow)."""
    s, c = SlowDetector(CFG), Clock()
    for step in range(3, 10):
        s.observe("metrics", {"step": step, "values": {"step_time_s": 0.1}}, c())
    for step in range(10, 40):
        s.observe("metrics", {"step": step, "values": {"step_time_s": 0.1, "tokens_per_s": 5000.0}}, c())
    assert s.reasons() == []
    assert s.check(c()) is None


def test_a_step_that_arrives_on_alive_just_before_its_phase_still_ends_setup():
    """The alive thread can carry step 1 a moment before the 'training' phase that reports it: the
    phase entry then moved nothing, the next movement (steps 1 -> 14) was taken for setup, no interval
    was learned, and a deadlock at step 15 waited out the first-step allowance (fault benchmark)."""
    d, c = started()
    d.observe("phase", {"name": "running"}, c())
    d.observe("alive", {"phase": "running", "step": 1}, c.tick(0.3))
    d.observe("phase", {"name": "training", "done": 1, "unit": "steps"}, c.tick(0.01))
    d.observe("alive", {"phase": "training", "step": 14}, c.tick(1.0))
    t_stuck = c()
    v = None
    while v is None and c() - t_stuck < 30:
        d.observe("alive", {"phase": "training", "step": 14}, c.tick(0.5))
        v = d.check(c())
    assert v is not None and v.kind == "stalled" and c() - t_stuck < 10, (c() - t_stuck, d.timeout())
