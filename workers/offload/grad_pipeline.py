"""The offloaded optimizer's gradient copies, one parameter ahead of its host step.

The offloaded Adam steps one parameter at a time on the host; before it can, that parameter's gradient must be
a host fp32 tensor. Copied in turn, the host waits for each copy and the link idles during each step (measured:
the offloaded step at 0.44x the in-device one on an H200, issue 48). Here the copy of the next parameter's
gradient starts before the current one steps:

- from a GPU: on a side stream (ordered after the stream that produced the gradient), ``non_blocking`` into one
  of two pinned buffers that alternate (the step reads one while the next copy fills the other), a CUDA event
  per copy that the step waits on;
- on a CPU (a bf16 or any gradient needing a cast): on one background thread, whose result the step waits for.

The values are the same copies as before, so the steps are bit-identical; ``trace`` (a list, or None) records
the order of ``("copy", i)`` starts and ``("step", i)`` steps, which the tests read instead of timing anything.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class GradPipeline:
    """Host fp32 copies of a sequence of gradients, each started by ``start(i, grad)`` and taken by ``take(i)``;
    at most two in flight (the one being stepped and the next)."""

    def __init__(self, trace: list | None = None):
        self.trace = trace
        self._buffers: list[torch.Tensor | None] = [None, None]  # pinned, alternating (GPU gradients)
        self._pending: dict[int, tuple[torch.Tensor, object]] = {}  # i -> (tensor, event or future)
        self._stream: torch.cuda.Stream | None = None
        self._thread: ThreadPoolExecutor | None = None

    def start(self, i: int, grad: torch.Tensor) -> None:
        """Begin copying ``grad`` (the ``i``-th) to a host fp32 tensor, without waiting for it."""
        if self.trace is not None:
            self.trace.append(("copy", i))
        if grad.device.type == "cuda":
            self._pending[i] = self._from_gpu(i, grad)
        elif grad.dtype == torch.float32:
            self._pending[i] = (grad, None)  # already what the step reads: nothing to copy
        else:
            self._thread = self._thread or ThreadPoolExecutor(1, thread_name_prefix="offload-grads")
            self._pending[i] = (grad, self._thread.submit(grad.to, torch.float32))

    def take(self, i: int) -> torch.Tensor:
        """The ``i``-th gradient as a host fp32 tensor, once its copy is done."""
        if self.trace is not None:
            self.trace.append(("step", i))
        tensor, done = self._pending.pop(i)
        if isinstance(done, Future):
            return done.result()
        if done is not None:
            done.synchronize()
        return tensor

    def _from_gpu(self, i: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A non-blocking copy of ``grad`` into pinned buffer ``i % 2`` on the side stream (grown to the largest
        gradient: pinning fresh memory per parameter would cost more than the copy)."""
        n, slot = grad.numel(), i % 2
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[slot] = torch.empty(n, dtype=torch.float32, pin_memory=True)
        self._stream = self._stream or torch.cuda.Stream(grad.device)
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))  # the gradient is complete
        with torch.cuda.stream(self._stream):
            host = buffer[:n].view(grad.shape).copy_(grad, non_blocking=True)
            grad.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        return host, done
