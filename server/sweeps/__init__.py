"""Sweeps: a search over a base job's settings whose trials are ordinary jobs (issue 32).

space.py  a sweep spec's checks (422 naming the field) and a trial's job spec
study.py  the Optuna study of a sweep: sampler, pruner, rebuilt from our tables
engine.py the loop that asks for trials, feeds the objective's live points to the pruner, settles
          ended trials; the one owner of every sweep's study in this process
"""
