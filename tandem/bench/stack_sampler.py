"""StackSampler: where one thread's wall time goes, by sampling its Python stack from another thread.

cProfile instruments every call (a host-bound engine step runs about twice as long under it) and
sees only the thread it was enabled on. A sampler thread that reads the watched thread's frame
every `interval_s` (sys._current_frames) costs one hand-over of the interpreter lock a sample,
time in C calls (a pipe write, a CUDA sync, a pickle) charged to the Python function that made
the call. While it runs, the interpreter's switch interval is cut to `switch_s` so that the
sampler gets the lock within that time of asking (at the default 5 ms a busy thread would be
sampled at most 200 times a second).

    sampler = StackSampler().start()     # the calling thread
    ...
    print(sampler.stop().report(30))

A sampler thread gets the lock only when the watched thread lets it go (at the latest after
`switch_s`): its samples fall on the watched thread's next release, so calls that release the
lock (a pinned upload, a pipe write, a CUDA sync) collect the samples of the Python work before
them (on the H100 an engine's pinned upload looked like 30-70% of its step). With
`mode="cpu"` (the main thread only) the process's CPU-time timer (SIGPROF) interrupts the main
thread instead and its handler records the frame the main thread is in, wherever it is: a CPU
profile (time blocked in a call is not sampled), without that bias.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from collections import Counter


def _where(code) -> str:
    path = code.co_filename
    parts = path.replace(os.sep, "/").split("/")
    short = "/".join(parts[-2:]) if "tandem" in parts else parts[-1]
    return f"{short}:{code.co_name}"


class StackSampler:
    def __init__(self, thread_id: int | None = None, interval_s: float = 0.001, switch_s: float = 0.0002,
                 mode: str = "thread"):
        if mode not in ("thread", "cpu"):
            raise ValueError(f"mode must be 'thread' or 'cpu' (got {mode!r})")
        if mode == "cpu" and threading.current_thread() is not threading.main_thread():
            raise ValueError("mode='cpu' samples the main thread: start it there")
        self.mode = mode
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.interval_s, self.switch_s = interval_s, switch_s
        self._old_handler = None
        self.own: Counter[str] = Counter()  # samples whose innermost Python frame is this function
        self.total: Counter[str] = Counter()  # samples with this function anywhere on the stack
        self.samples = 0
        self._old_switch = sys.getswitchinterval()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-stack-sampler", daemon=True)

    def start(self) -> "StackSampler":
        if self.mode == "cpu":
            self._old_handler = signal.signal(signal.SIGPROF, lambda signum, frame: self._record(frame))
            signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)
            return self
        sys.setswitchinterval(self.switch_s)
        self._thread.start()
        return self

    def stop(self) -> "StackSampler":
        if self.mode == "cpu":
            signal.setitimer(signal.ITIMER_PROF, 0, 0)
            signal.signal(signal.SIGPROF, self._old_handler or signal.SIG_DFL)
            return self
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._old_switch)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record(sys._current_frames().get(self.thread_id))

    def _record(self, frame) -> None:
        if frame is None:
            return
        self.samples += 1
        self.own[_where(frame.f_code)] += 1
        seen = set()
        while frame is not None:
            key = _where(frame.f_code)
            if key not in seen:
                seen.add(key)
                self.total[key] += 1
            frame = frame.f_back

    def report(self, top: int = 30) -> str:
        """The `top` functions by own samples, then by samples on the stack (% of all samples)."""
        n = max(self.samples, 1)
        clock = "of the process's CPU time" if self.mode == "cpu" else "of wall time (at lock releases)"
        lines = [f"{self.samples} samples, every {self.interval_s * 1e3:g} ms {clock}", "own %  function"]
        lines += [f"{100 * c / n:5.1f}  {k}" for k, c in self.own.most_common(top)]
        lines += ["on stack %  function"]
        lines += [f"{100 * c / n:5.1f}  {k}" for k, c in self.total.most_common(top)]
        return "\n".join(lines)
