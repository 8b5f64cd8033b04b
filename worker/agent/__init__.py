"""The agent: claims jobs over HTTP, supervises their processes, relays their events, judges stalls.

Torch-free by design (a test asserts it): it must start fast and never hold a GPU.
"""
from worker.agent.agent import Agent

__all__ = ["Agent"]
