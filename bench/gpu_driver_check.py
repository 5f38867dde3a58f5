"""The engine process's loop without HTTP: the served engine's cost of being served, in steps.

Three runs of the same requests (N of them, at most C in flight, the next added as one ends):
  offline  the engine stepped in a plain loop (as `tandem bench --concurrency`);
  driver   tandem serve's engine-process driver (_ChildDriver: publish each step's tokens, record
           metrics, pickle one message a turn) on this thread, its messages written to a pipe that
           another process drains, requests added from another thread as the ends are sent;
  driverN  the same, one write every N turns (the messages of N turns pickled together);
  nopipe   the same driver, its messages pickled but not written.
Each prints tokens a second, steps, the mean ms of Engine.step and of a whole loop turn.

    python bench/gpu_driver_check.py --method ar --concurrency 64 --requests 512     (on the GPU)
    python bench/gpu_driver_check.py --device cpu --target /tmp/tiny --method ar --concurrency 64 --requests 256
"""
from __future__ import annotations

import argparse
import multiprocessing
import pickle
import threading
import time
from concurrent.futures import Future

from tandem.bench.workloads import load_workload
from tandem.engine.config import EngineConfig
from tandem.engine.request import SamplingParams
from tandem.runtime.pair import load_pair
from tandem.serve.config import engine_config_for
from tandem.serve.driver import Job
from tandem.serve.engine_process import _ChildDriver, _Recorder
from tandem.serve.logprobs import LogprobEngine


def _drain(conn) -> None:
    """The other end of the pipe: say it is reading, then read and drop every message until the
    pipe closes (the writer waits for the first: a spawned child takes seconds to import, and
    writes into a pipe nobody reads block once its buffer is full)."""
    conn.send_bytes(b"ready")
    try:
        while True:
            conn.recv_bytes()
    except EOFError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default="eagle3")
    ap.add_argument("--method", default="ar")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--runs", default="offline,driver,nopipe,offline",
                    help="in order; driverN: one pipe write every N turns")
    a = ap.parse_args()
    pair = load_pair(a.target, None if a.method == "ar" else a.draft, a.device,
                     "bfloat16" if a.device == "cuda" else "float32", need_draft=a.method != "ar")
    texts = [p.text for p in load_workload("mbpp", 64, a.data_dir)]
    prompts = [pair.tokenizer.encode(t).ids[-256:] for t in texts]
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    C, N = a.concurrency, a.requests

    def engine():
        cfg = engine_config_for(EngineConfig(max_num_seqs=max(32, C)), a.method)
        return LogprobEngine(pair.target, pair.draft if a.method != "ar" else None, pair.tokenizer, cfg)

    def offline(eng) -> tuple[float, int]:
        t0, sent = time.perf_counter(), 0
        s0 = eng.steps
        for _ in range(C):
            eng.add_request(prompts[sent % len(prompts)], params, request_id=str(sent))
            sent += 1
        while eng.has_unfinished():
            for _ in eng.step():
                if sent < N:
                    eng.add_request(prompts[sent % len(prompts)], params, request_id=str(sent))
                    sent += 1
        return time.perf_counter() - t0, eng.steps - s0

    def served(eng, pipe: bool, every: int = 1) -> tuple[float, int]:
        ends = threading.Semaphore(0)
        conn = proc = None
        if pipe:
            conn, child = multiprocessing.get_context("spawn").Pipe()
            proc = multiprocessing.get_context("spawn").Process(target=_drain, args=(child,), daemon=True)
            proc.start()
            child.close()
            conn.recv_bytes()  # (the drain reads)

        held: list = []

        def send(msg) -> None:
            held.append(msg)  # (every: one write for that many turns' messages)
            if len(held) >= every or msg[0] != "events":
                data = pickle.dumps(held)
                held.clear()
                if conn is not None:
                    conn.send_bytes(data)
            if msg[0] == "events":
                for _ in msg[6]:  # (the ends)
                    ends.release()

        drv = _ChildDriver({a.method: eng}, _Recorder(), send)
        s0 = eng.steps

        def submit() -> None:
            for i in range(N):
                if i >= C:
                    ends.acquire()
                drv.commands.put(("add", Job(f"r{i}", prompts[i % len(prompts)], params, a.method, None), Future()))
            for _ in range(C):
                ends.acquire()
            drv.stop(timeout=0)

        t0 = time.perf_counter()
        threading.Thread(target=submit, daemon=True).start()
        drv.run()  # (this thread: the engine process's main thread does the same)
        wall = time.perf_counter() - t0
        if conn is not None:
            conn.close()
            proc.join(10)
        return wall, eng.steps - s0

    import gc

    import torch

    for name in a.runs.split(","):
        gc.collect()  # (the last run's engine: its graphs and pinned buffers go before this one starts)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        eng = engine()
        every = int(name[len("driver"):] or 1) if name.startswith("driver") else 1
        run_once = offline if name == "offline" else (lambda e: served(e, name != "nopipe", every))
        run_once(eng)  # (a warm-up round: graphs, first shapes)
        k0 = (eng.counters.step_s, eng.counters.steps)
        wall, steps = run_once(eng)
        step_s = (eng.counters.step_s - k0[0]) / max(1, eng.counters.steps - k0[1])
        print(f"{name}: {N * a.max_tokens / wall:.0f} tok/s, {steps} steps, Engine.step {step_s * 1e3:.3f} ms, "
              f"a turn {wall / max(1, steps) * 1e3:.3f} ms", flush=True)
        del eng
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
