"""Tensor parallelism: one model across N devices of a pod.

Rank 0 is the engine process itself: it runs the scheduler, the block manager, the
sampler and its own shard of the model. Ranks 1..N-1 are worker processes it starts
(``WorkerProcess``, one per device: fresh interpreters that import llmserve, never the
caller's main module), which loop in ``_worker_loop``:

1. receive the step once, over a pipe from rank 0: the step's block moves (swap-out,
   swap-in, copy-on-write, in decision order) and the flat batch (``StepInputs``:
   token ids, positions, slots, block tables, query offsets, rows that sample) -- plain
   lists pickled once per step, a few KB, not per layer;
2. apply the block moves to their own KV cache (each rank caches its own KV heads, so
   the block tables, prefix caching included, are the same on every rank);
3. run their shard's forward: the all-reduces after ``o_proj``, ``down_proj`` and the
   vocab-parallel embedding happen inside the layers (``torch.distributed``: NCCL on
   CUDA, gloo on CPU), and the LM head's logits shards are gathered onto rank 0,
   which alone samples.

A worker that dies is noticed by rank 0's watchdog thread (its process sentinel), and
by the collective or pipe write that fails; the engine then fails (``/health`` 503,
``llmserve serve`` exits non-zero, the pod restarts). A worker whose rank 0 is gone
reads EOF on its pipe, or fails its collective, and exits.

The collectives are ``llmserve.distributed.comm``; which rows and columns each rank loads
is ``model_executor/model_loader/shards.py``; the step message is ``worker/step_inputs.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from llmserve.distributed.comm import COLLECTIVE_TIMEOUT, backend_for
from llmserve.errors import WorkerDiedError  # noqa: F401 - raised here, re-exported
from llmserve.utils import free_port
from llmserve.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)




# --- processes --------------------------------------------------------------------------


class WorkerProcess:
    """One worker rank: ``python -c`` running ``_worker_bootstrap``, with a duplex pipe to
    rank 0 and the arguments of ``_worker_main`` sent over it.

    Not multiprocessing's spawn: a spawned child re-runs the caller's main script (as
    ``__mp_main__``) to find what it must unpickle, so a script that builds an
    ``LLM(..., tensor_parallel_size=N)`` at module level, without an
    ``if __name__ == "__main__":`` guard, would build another engine inside each worker
    (and multiprocessing refuses to start processes there). A worker needs nothing of
    the caller's main module (its target and arguments are llmserve's), so it starts
    a fresh interpreter that imports only llmserve. The surface is the part of
    ``multiprocessing.Process`` the group uses: pid, sentinel, exitcode, join, kill."""

    def __init__(self, rank: int, worker_args: tuple):
        self.conn, child = multiprocessing.Pipe()
        # Readable (EOF) once the worker is gone: it holds the only write end.
        self.sentinel, held_by_worker = os.pipe()
        # The caller's import path, so llmserve imports in the worker as it did here
        # (e.g. a source checkout found through the script's directory).
        path = [p or os.getcwd() for p in sys.path]
        # SIGINT ignored first: a Ctrl-C while the worker imports torch is rank 0's.
        code = (f"import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                f"sys.path[:0] = {path!r}; "
                f"from llmserve.executor.tensor_parallel import _worker_bootstrap; "
                f"_worker_bootstrap({child.fileno()})")
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", code, f"llmserve-tp-rank{rank}"],
                pass_fds=(child.fileno(), held_by_worker))
        finally:
            child.close()
            os.close(held_by_worker)
        self.pid = self._popen.pid
        weakref.finalize(self, os.close, self.sentinel)
        try:
            self.conn.send(worker_args)
        except OSError:
            pass  # it died at once: the group's wait for "hello" says how

    @property
    def exitcode(self) -> int | None:
        """As multiprocessing's: None while it runs, -N after signal N."""
        if self._popen.returncode is None and mpc.wait([self.sentinel], timeout=0):
            # Its descriptors are closed, so it is exiting; it may just not be a zombie
            # yet, which a non-blocking poll would read as "running".
            self._popen.wait()
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


def _worker_bootstrap(fd: int) -> None:
    """A worker's entry point (see ``WorkerProcess``): its arguments, then its life."""
    # Ctrl-C reaches the whole process group; rank 0 alone decides, and its workers
    # stop when it tells them or when it is gone (EOF on the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = mpc.Connection(fd)
    _worker_main(*conn.recv(), conn)


class TensorParallelGroup:
    """Rank 0's handle on the workers: start, per-step messages, supervision, stop."""

    def __init__(self, config, hf_config, model_path, max_model_len: int):
        self.size = config.tensor_parallel_size
        if dist.is_initialized():
            raise ValueError("this process already runs a tensor-parallel engine (one "
                             "torch.distributed group per process); shut it down first")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[WorkerProcess] = []
        self.conns: list[mpc.Connection] = []
        self.failure: str | None = None
        self._stopping = False
        try:
            for rank in range(1, self.size):
                p = WorkerProcess(rank, (rank, init_method, config, hf_config,
                                         str(model_path), max_model_len))
                self.procs.append(p)
                self.conns.append(p.conn)
            self._expect("hello")  # imported torch: now all ranks can rendezvous
            dist.init_process_group(backend_for(config.device), init_method=init_method,
                                    rank=0, world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise

    def _expect(self, what: str) -> None:
        """Every worker's next message is ``what``; a worker's error or death raises."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while True:
                # No timeout: loading a big shard takes what it takes, a dead worker
                # wakes this up through its sentinel, and a hung one makes rank 0's
                # start-up collective time out.
                ready = mpc.wait([conn, p.sentinel])
                if conn in ready and conn.poll():
                    try:
                        kind, detail = conn.recv()
                    except EOFError:  # it died: say how, below
                        pass
                    else:
                        if kind == "error":
                            raise WorkerDiedError(
                                f"tensor-parallel rank {rank} failed: {detail}")
                        assert kind == what, (kind, what)
                        break
                p.join(1)
                raise WorkerDiedError(f"tensor-parallel rank {rank} (pid {p.pid}) exited "
                                      f"with {_describe_exit(p.exitcode)} before {what!r}")

    def worker_errors(self) -> str | None:
        """The first error a worker reported, if any (after a failed start)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll(0.5):
                    kind, detail = conn.recv()
                    if kind == "error":
                        return f"tensor-parallel rank {rank} failed: {detail}"
            except (EOFError, OSError):
                continue
        return None

    def wait_ready(self) -> None:
        """After rank 0 built its own shard: every worker has built its shard."""
        self._expect("ready")
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while not self._stopping:
            dead = mpc.wait(list(sentinels), timeout=0.5)
            if dead and not self._stopping:
                rank, p = sentinels[dead[0]]
                p.join(1)
                self.failure = (f"tensor-parallel worker rank {rank} (pid {p.pid}) exited "
                                f"with {_describe_exit(p.exitcode)}")
                log.error("%s; the engine stops", self.failure)
                return

    def blame(self, error: BaseException) -> BaseException:
        """The error to raise for a failed collective or send: the worker that died,
        if one did (its exit may reach us a moment after the broken connection)."""
        mpc.wait([p.sentinel for p in self.procs], timeout=1.0)
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {p.pid}) "
                                       f"exited with {_describe_exit(p.exitcode)}")
        return error

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def send(self, message: tuple) -> None:
        """One message to every worker (pickled once)."""
        self.check()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as e:
            raise WorkerDiedError(f"a tensor-parallel worker is gone ({e})") from e

    def shutdown(self) -> None:
        """Stop the workers (politely, then SIGKILL) and leave the process group."""
        self._stopping = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code yet"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _worker_main(rank: int, init_method: str, config, hf_config, model_path: str,
                 max_model_len: int, conn) -> None:
    """A worker process: rendezvous, load this rank's shard, then serve steps."""
    try:
        conn.send(("hello", None))
        if config.device.startswith("cuda"):
            torch.cuda.set_device(rank)
        dist.init_process_group(backend_for(config.device), init_method=init_method,
                                rank=rank, world_size=config.tensor_parallel_size,
                                timeout=COLLECTIVE_TIMEOUT)
        runner = ModelRunner(config, hf_config, Path(model_path), max_model_len, rank=rank)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then exit
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise SystemExit(1) from e
    try:
        _worker_loop(runner, conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def _worker_loop(runner, conn) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # rank 0 is gone
        kind = message[0]
        if kind == "stop":
            return
        if kind == "step":
            _, ops, inputs = message
            if ops:
                runner.kv_cache.apply(ops)
            if inputs is not None:
                runner.execute(inputs)
        elif kind == "warm_up":
            runner.warm_up_kernels(*message[1:])
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")
