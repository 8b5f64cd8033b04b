"""Limits the server enforces that code on the other side (the agent, the training process's metric
capture) may read to stay within them, rather than learn them from a refusal."""

# Distinct metric names one job may log (the server's default: Settings.metric_names_per_job,
# TOKENPULSE_METRIC_NAMES_PER_JOB). Past it the server stores no point of a further name and raises
# one warning alert (`metric_names_limit`) on the job.
METRIC_NAMES_PER_JOB = 5000
