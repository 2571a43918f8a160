"""A decode worker's engine core in its own process (`--engine-core-process`; the API side is
decode/core_client.py, the wire decode/core_wire.py).

It loads the engine, times the calibration steps if asked, and runs the one engine loop
(`AsyncEngine`, its failure containment unchanged) with an event loop that only moves
frames: requests, aborts and step-plan settings in; each step's deltas (one frame a step),
the items emitted between steps and the engine's death out. A thread answers the reads the
API process makes at admission (the prefix cache's hit, the load, the step under way), as
the worker's event loop read them beside the engine thread in one process.

Started by the API process with both socket pairs' ends inherited (``--stream-fd``,
``--reads-fd``); it ends when the stream closes (its API process is gone), on a ``stop``
frame, or after telling its API process that the engine died.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import select
import signal
import socket
import sys
import threading
from dataclasses import asdict
from typing import Any, Callable

from pdserve.cluster.kvindex.publisher import record_endpoints, start_event_publisher
from pdserve.cluster.runtime import freeze_gc_heap
from pdserve.common import jsonlog
from pdserve.common.thread_cpu import ThreadCPU
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.calibrate import measure_steps
from pdserve.engine.driver import StepInfo

from . import core_wire as wire
from .async_engine import AsyncEngine
from .spec_metrics import spec_outlook

log = logging.getLogger("pdserve.decode.core")


class CoreLoop(AsyncEngine):
    """`AsyncEngine` whose deliveries are frames to the API process, not asyncio queues."""

    def __init__(self, engine: LLMEngine, writer: asyncio.StreamWriter):
        super().__init__(engine, on_step=self._no_op, on_death=self._died)
        self.writer = writer
        self.dead = asyncio.Event()

    @staticmethod
    def _no_op(_info: StepInfo) -> None:
        """Set so that every step is delivered, also one that emitted nothing (its cost counts)."""

    def _send(self, msg: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(wire.pack(msg))

    def _deliver_step(self, batch: list, info: StepInfo) -> None:
        eng = self.engine
        self._send({"t": "step", "items": [[rid, wire.delta_out(d), wire.final_out(f)] for rid, d, f in batch],
                    "info": wire.info_out(info), "budget": eng.prefill_token_budget})

    def _emit(self, rid: str, item, final) -> None:  # engine thread
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._send_item, rid, item, final)

    def _send_item(self, rid: str, item, final) -> None:
        if isinstance(item, BaseException):
            self._send({"t": "item", "rid": rid, "error": wire.error_out(item)})
        else:
            self._send({"t": "item", "rid": rid, "delta": wire.delta_out(item), "final": wire.final_out(final)})

    def _died(self, exc: BaseException) -> None:
        self._send({"t": "dead", "error": wire.error_out(exc)})
        self.dead.set()


def _reads(engine: LLMEngine, core: CoreLoop) -> dict[str, Callable[..., Any]]:
    """What the API process may read, each as the worker read it beside the engine thread."""
    conn = engine.connector
    return {
        "load": lambda: wire.load_out(engine.load()),
        "cached_prefix_len": lambda ids, salt: conn.cached_prefix_len(ids, salt),
        "tier_prefix_len": lambda ids, cached, salt: conn.tier_prefix_len(ids, cached, salt),
        "tier_load_ms_per_token": conn.tier_load_ms_per_token,
        "predicted_prefill_budget": engine.predicted_prefill_budget,
        "prompt_left": engine.prompt_left,
        "prompts_left": lambda rids: [engine.prompt_left(rid) for rid in rids],
        "spec_outlook": lambda streams: list(spec_outlook(engine, streams)),
        "in_flight": lambda: core.in_flight,
        "stats": lambda: asdict(engine.stats),
        "grammar_stats": engine.grammar_stats,
        "tier_stats": engine.tier_stats,
        "counters": lambda: dict(core.counters),
        "thread_cpu": ThreadCPU().read,
    }


def _answer_reads(sock: socket.socket, reads: dict[str, Callable[..., Any]]) -> None:
    """The reads thread: one reply per request until the API process closes the socket."""
    while True:
        try:
            msg = wire.recv(sock)
        except (wire.WireError, OSError):
            return
        try:
            body = wire.pack({"t": "ok", "v": reads[msg["t"]](*msg.get("a", ()))})
        except Exception as exc:  # noqa: BLE001  (the reader's error, raised on the API side)
            body = wire.pack({"t": "err", "e": wire.error_out(exc)})
        try:
            sock.sendall(body)
        except OSError:
            return


async def serve(engine: LLMEngine, stream: socket.socket, reads_sock: socket.socket) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=stream)
    core = CoreLoop(engine, writer)
    core.start()
    threading.Thread(target=_answer_reads, args=(reads_sock, _reads(engine, core)),
                     name="pdserve-core-reads", daemon=True).start()
    dead = asyncio.ensure_future(core.dead.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(wire.read(reader))
            done, _ = await asyncio.wait({nxt, dead}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                break  # the engine died: its API process was told; this process ends
            try:
                msg = nxt.result()
            except wire.WireError:
                break  # the API process is gone
            if not _apply(core, msg):
                break
    finally:
        core.stop()
        if not core.thread_running:  # (not while it still steps: as the worker in one process)
            engine.close()
        try:
            await writer.drain()
            writer.close()
        except (ConnectionError, OSError):
            pass


def _apply(core: CoreLoop, msg: dict) -> bool:
    """One frame from the API process; False: stop."""
    t = msg["t"]
    if t == "add":
        core.post_add(msg["rid"], msg["ids"], wire.params_in(msg["params"]), msg["priority"], msg.get("tenant"),
                      msg.get("resume"), lora=wire.lora_in(msg.get("lora")))
    elif t == "abort":
        core.abort(msg["rid"])
    elif t == "plan":
        core.set_step_targets(*wire.plan_in(msg))
    elif t == "budget":
        core.set_prefill_token_budget(msg["tokens"])
    elif t == "stop":
        return False
    else:
        log.error("engine core: unknown frame %r; ignored", t)
    return True


def _parent_gone(stream: socket.socket) -> bool:
    """Whether the API process closed its end (nothing is sent before the ready frame)."""
    readable, _, _ = select.select([stream], [], [], 0)
    if not readable:
        return False
    try:
        return stream.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _ready(engine: LLMEngine, calibration: list) -> dict:
    conn = engine.connector
    cfg = engine.config
    return {"t": "ready", "pid": os.getpid(), "block_size": cfg.block_size,
            "vocab_size": engine.model_config.vocab_size, "max_model_len": engine.max_model_len,
            "max_num_seqs": cfg.max_num_seqs, "enable_lora": bool(cfg.enable_lora), "max_lora_rank": cfg.max_lora_rank,
            "enable_prefix_caching": bool(cfg.enable_prefix_caching), "layout": conn.layout_info(),
            "kv_bytes_per_token": conn.kv_bytes_per_token, "spec": engine.spec is not None, "tier": engine.tier is not None,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "grammar": {"timeout_s": cfg.structured_outputs_timeout_s,
                        "cache_entries": cfg.structured_outputs_cache_entries,
                        "cache_bytes": cfg.structured_outputs_cache_bytes,
                        "threads": cfg.structured_outputs_threads, "nice": cfg.structured_outputs_compile_nice},
            "device": str(conn.kv_tensor.device), "calibration": [list(s) for s in calibration]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.decode.core_process",
                                 description="A decode worker's engine core (started by the worker itself).")
    ap.add_argument("--stream-fd", type=int, required=True)
    ap.add_argument("--reads-fd", type=int, required=True)
    args = ap.parse_args(argv)
    # A terminal's Ctrl-C, or a SIGTERM to the whole process group (a supervisor's stop), is the
    # API process's to handle: it drains, then stops this one (a stop frame, or its stream's end).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The reads thread waits for the interpreter lock while the engine thread runs Python: at most
    # this long (the default 5 ms would hold an admission up for as long).
    sys.setswitchinterval(0.001)
    stream = socket.socket(fileno=args.stream_fd)
    reads_sock = socket.socket(fileno=args.reads_fd)
    init = wire.recv(stream)
    if init.get("log_format", "text") != "text":
        jsonlog.setup(init["log_format"])
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded: dict[str, Any] = {}

    def load() -> None:
        try:
            engine = LLMEngine(EngineConfig.from_kwargs(init["model"], **init["engine_args"]))
            loaded["calibration"] = measure_steps(engine) if init.get("calibrate") else []
            loaded["engine"] = engine
        except Exception as exc:  # noqa: BLE001  (the API process names it and exits)
            log.exception("engine core: the engine did not start")
            loaded["error"] = exc

    # Loaded and calibrated on a thread that ends: the OpenMP team it made goes with it, and
    # only the engine thread's runs beside the step (common/compute_thread.py says why).
    loader = threading.Thread(target=load, name="pdserve-load", daemon=True)
    loader.start()
    while loader.is_alive():
        loader.join(0.5)
        if loader.is_alive() and _parent_gone(stream):
            log.error("engine core: its API process is gone while the engine loads; exiting")
            os._exit(1)
    if "engine" not in loaded:
        wire.send(stream, {"t": "failed", "error": wire.error_out(loaded.get("error") or RuntimeError("no engine"))})
        return 1
    engine, calibration = loaded["engine"], loaded["calibration"]
    if init.get("freeze_gc"):
        freeze_gc_heap("engine core")
    # The engine's KV events (engine arg kv_events) leave from here, where its log is, on the
    # worker's address (cluster/kvindex/publisher.py); the worker's record names the endpoints.
    publisher = start_event_publisher(engine, init.get("host") or "127.0.0.1")
    try:
        wire.send(stream, {**_ready(engine, calibration), "kv_events": record_endpoints(publisher)})
        asyncio.run(serve(engine, stream, reads_sock))
    finally:
        if publisher is not None:
            publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
