"""Agent event batches -> one transaction per batch -> live frames for the hub.

Runs on the writer thread, parsing included: the event loop only receives the body bytes and sends
the reply, so a 5,000-event batch never blocks websocket fan-out. One module per responsibility:

- parse.py       body bytes -> checked events (a hand-written fast path for metric points)
- apply.py       a batch -> one transaction: watermarks, events applied to their jobs, live frames
- metrics.py     metric rows and their 256-step rollups (first/last/min/max)
- alerts.py      one open alert per (job, kind): raise, update, clear
- heartbeats.py  an agent is alive; the commands waiting for it

Exactly once: each job keeps a watermark (next_seq); events below it are replays and are
acknowledged without being stored again, and the metrics primary key (job, key, step) makes any
point that does slip through overwrite itself.
"""
