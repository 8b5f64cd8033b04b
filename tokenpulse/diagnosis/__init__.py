"""Judging whether a process is stuck, and where: torch-free and free of the agent and the server,
so the agent (worker/agent/) and the standalone watchdog (tokenpulse/watchdog.py) share one copy.

- stall.py    the stall rules: pure logic over observed progress, with the clock passed in
- stacks.py   reading a process's stacks from outside it (py-spy, /proc state)
- capture.py  the one stack-capture ladder: py-spy, the process's faulthandler, py-spy --nonblocking
"""
