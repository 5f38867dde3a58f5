"""A small torch op on the main thread and on a second thread: the cost that made the served engine
step on the thread that loaded its models (tandem.serve.driver.spare_main_thread).

    python bench/cpu_thread_ops.py

Prints microseconds a call of a [64, 64] x [64, 128] linear in two fresh processes: one whose main
thread runs the op first and then a second thread runs it; one whose main thread gives up its
intra-op threads before any op (spare_main_thread) and hands them to the second thread.
"""
from __future__ import annotations

import multiprocessing
import threading
import time


def time_linear(calls: int = 3000) -> float:
    import torch

    x, w = torch.randn(64, 64), torch.randn(128, 64)
    for _ in range(200):
        torch.nn.functional.linear(x, w)
    t = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - t) / calls * 1e6


def on_second_thread(threads: int | None = None) -> float:
    import torch

    out = []

    def body():
        if threads:
            torch.set_num_threads(threads)
        out.append(time_linear())

    th = threading.Thread(target=body)
    th.start()
    th.join()
    return out[0]


def scenario(spare: bool) -> list[str]:
    import torch

    from tandem.serve.driver import spare_main_thread

    if spare:  # (before any op on the main thread, as tandem serve does before it loads the models)
        n = spare_main_thread("cpu")
        return [f"main thread, 1 intra-op thread: {time_linear():.1f} us a call",
                f"second thread, given {n}: {on_second_thread(n):.1f} us a call"]
    n = torch.get_num_threads()
    return [f"main thread, {n} intra-op threads: {time_linear():.1f} us a call",
            f"second thread after it: {on_second_thread():.1f} us a call"]


def main() -> int:
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    ctx = multiprocessing.get_context("spawn")  # (a fresh process each: a formed thread team stays)
    with ctx.Pool(1) as pool:
        for line in pool.apply(scenario, (False,)):
            print(line)
    with ctx.Pool(1) as pool:
        for line in pool.apply(scenario, (True,)):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
