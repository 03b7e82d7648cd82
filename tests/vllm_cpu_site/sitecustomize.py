"""Test-only: vLLM's CPU build with stand-ins for the CUDA-only lines of its hidden-states
connector's write, in every process that imports Python with this folder on PYTHONPATH and
EYAS_CPU_CONNECTOR_STUBS=1: the capture's own process, vLLM's engine core and each
tensor-parallel worker (they start by spawn, so monkeypatches in the test's process do not
reach them; `cpu_engine_stubbed` in test_capture_vllm.py does the same in one process).

The stand-ins (as there): `torch.empty_like` without pinned memory, torch.cuda.Stream and
torch.cuda.stream as no-ops, torch.cuda.Event / torch.Event with the `query()` the connector
calls. vLLM's CPU worker replaces the Event by a placeholder without `query()` when it imports
vllm.v1.worker.cpu.shm, so ours goes back in right after that import. Everything else is
vLLM's own.
"""

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys


class Event:
    """torch.cuda.Event / torch.Event for the connector on the CPU: its copies are synchronous
    there (test_capture_vllm.py's in-process fixture uses it too)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class Stream(Event):
    def wait_event(self, *args):
        pass


class _EventBackAfterShm(importlib.abc.MetaPathFinder):
    """Puts Event back once vLLM's CPU worker has installed its own placeholder."""

    def find_spec(self, name, path, target=None):
        if name != "vllm.v1.worker.cpu.shm":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            import torch

            run(module)
            torch.cuda.Event = torch.Event = Event

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("EYAS_CPU_CONNECTOR_STUBS") == "1":
    import torch

    _empty_like = torch.empty_like
    torch.empty_like = lambda t, *a, pin_memory=False, **k: _empty_like(t, *a, **k)
    torch.cuda.Stream = Stream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.Event = torch.Event = Event
    sys.meta_path.insert(0, _EventBackAfterShm())
