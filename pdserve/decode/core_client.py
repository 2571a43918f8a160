"""The API process's side of an engine core in its own process (`--engine-core-process`).

`EngineCoreClient` is what `AsyncEngine` is to the frontend (submit, abort, the streams of
deltas, the reads the router makes at admission, `on_step` and `on_death`), over the wire of
decode/core_wire.py to decode/core_process.py; `CoreEngineView` is what the worker reads of
its `LLMEngine` (its layout, load, counters and calibration). Tokenizing (the APIs' prompt
checks, a tokenizer of its own), HTTP, streaming and routing stay in the API process; the
engine loop, the scheduler, the KV pool and detokenization run in the core.

An engine core that exits or breaks the wire is an engine death: every stream gets
`EngineDeadError` and ``on_death`` runs, as when the engine thread dies in one process.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from pdserve.engine import EngineLoad, EngineStats, LoRARequest, ModelConfig, SamplingParams
from pdserve.engine.driver import StepInfo
from pdserve.engine.prompts import PromptChecker
from pdserve.engine.structured import GrammarCompiler
from pdserve.engine.tokenizer import Tokenizer

from . import core_wire as wire
from .async_engine import EngineDeadError

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a read the core does not answer in this long: the core is taken for dead
STOP_WAIT_S = 10.0


class CoreStartError(RuntimeError):
    """The engine-core process did not start its engine (the cause is in its message)."""


class _ConnectorView:
    """The connector's facts and reads the API process uses (engine/kv_connector.py)."""

    def __init__(self, client: "EngineCoreClient", ready: dict):
        self._client = client
        self._layout = dict(ready["layout"])
        self.kv_bytes_per_token: int = ready["kv_bytes_per_token"]
        self.kv_tensor = SimpleNamespace(device=ready["device"])  # (cluster/load.py gpu_load reads its device)
        self.reservations_pending = False
        self._tier = bool(ready["tier"])

    def layout_info(self) -> dict:
        return dict(self._layout)

    def cached_prefix_len(self, token_ids: list[int], salt: bytes | None = None) -> int:
        return int(self._client.read("cached_prefix_len", list(token_ids), salt))

    def tier_prefix_len(self, token_ids: list[int], cached: int, salt: bytes | None = None) -> int:
        if not self._tier:
            return 0  # (no second tier: nothing to ask)
        return int(self._client.read("tier_prefix_len", list(token_ids), cached, salt))

    def tier_load_ms_per_token(self) -> float:
        return float(self._client.read("tier_load_ms_per_token")) if self._tier else 0.0


class EngineCoreClient:
    """A running engine-core process, as the frontend and the worker use an `AsyncEngine`."""

    def __init__(self, model: str, proc: subprocess.Popen, stream: socket.socket, reads: socket.socket, ready: dict,
                 prompts: PromptChecker, on_step: Callable[[StepInfo], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None):
        self.model = model
        self.proc = proc
        self._stream = stream
        self._reads = reads
        self._reads_lock = threading.Lock()
        self.ready = ready
        self.prompts = prompts
        self.connector = _ConnectorView(self, ready)
        self.block_size: int = ready["block_size"]
        self.vocab_size: int = ready["vocab_size"]
        self.on_step = on_step  # each step's StepInfo (the worker's cost model), as AsyncEngine's
        self.on_death = on_death
        self.error: BaseException | None = None
        self.prefill_token_budget: int | None = None  # the step plan's, as of the last step
        self._streams: dict[str, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._stopping = False
        self._last_load = EngineLoad(0, 0, 0, 0, 0, 0.0)
        self._last_stats = EngineStats()

    @classmethod
    async def launch(cls, model: str, engine_args: dict, *, on_step: Callable[[StepInfo], None] | None = None,
                     on_death: Callable[[BaseException], None] | None = None, host: str = "127.0.0.1",
                     log_format: str = "text", calibrate: bool = False,
                     freeze_gc: bool = False, start_timeout_s: float = 900.0) -> "EngineCoreClient":
        """Start the core process and wait until its engine is loaded (CoreStartError if it is not)."""
        stream, core_stream = socket.socketpair()
        reads, core_reads = socket.socketpair()
        cmd = [sys.executable, "-m", "pdserve.decode.core_process",
               "--stream-fd", str(core_stream.fileno()), "--reads-fd", str(core_reads.fileno())]
        proc = subprocess.Popen(cmd, pass_fds=(core_stream.fileno(), core_reads.fileno()))
        core_stream.close()
        core_reads.close()
        writer: asyncio.StreamWriter | None = None
        try:
            wire.send(stream, {"t": "init", "model": model, "engine_args": engine_args, "log_format": log_format,
                               "calibrate": calibrate, "freeze_gc": freeze_gc, "host": host})
            reader, writer = await asyncio.open_unix_connection(sock=stream)
            try:
                msg = await asyncio.wait_for(wire.read(reader), start_timeout_s)
            except wire.WireError:
                code = await asyncio.get_running_loop().run_in_executor(None, _wait, proc, 5.0)
                raise CoreStartError(f"the engine-core process exited before its engine started (exit code {code})")
            except asyncio.TimeoutError:
                raise CoreStartError(f"the engine-core process did not load its engine within {start_timeout_s:g} s")
            if msg["t"] == "failed":
                err = msg["error"]
                raise CoreStartError(f"the engine did not start: {err['kind']}: {err['message']}")
            reads.settimeout(READ_TIMEOUT_S)
            tokenizer = Tokenizer(model)
            # the edge's check compiles with the engine's settings (its own cache: the core compiles again)
            grammars = GrammarCompiler(tokenizer, msg["vocab_size"], msg["eos_token_ids"], **msg["grammar"])
            prompts = PromptChecker(tokenizer, msg["max_model_len"], msg["vocab_size"], grammars)
        except BaseException:
            _end(proc)
            if writer is not None:
                writer.close()
            else:
                stream.close()
            reads.close()
            raise
        client = cls(model, proc, stream, reads, msg, prompts, on_step, on_death)
        client._writer = writer
        client._reader_task = asyncio.ensure_future(client._read_loop(reader))
        log.info("engine core running in process %d", msg["pid"])
        return client

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, pollers: Sequence = (), after_schedule: Sequence = ()) -> None:
        """The core's loop is running since `launch`; the remote path's hooks live in one process."""
        if pollers or after_schedule:
            raise ValueError("engine_core_process: the remote path's hooks run beside the engine in one process")

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Ask the core to stop, wait for it (killed after ``timeout_s``), close the wire."""
        if self._stopping:
            return
        self._stopping = True
        self._send({"t": "stop"})
        code = _wait(self.proc, timeout_s)
        if code is None:
            log.error("engine core %d did not stop within %.1f s; killed", self.proc.pid, timeout_s)
            _end(self.proc)
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
        self._reads.close()
        self.prompts.grammars.close()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping and self.proc.poll() is None

    @property
    def thread_running(self) -> bool:
        return self.proc.poll() is None

    # -- reads ---------------------------------------------------------------------------------
    def read(self, what: str, *args: Any) -> Any:
        """One read answered by the core's reads thread (a blocking round trip)."""
        if self.error is not None:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        with self._reads_lock:
            try:
                wire.send(self._reads, {"t": what, "a": list(args)})
                reply = wire.recv(self._reads)
            except (wire.WireError, OSError) as exc:
                dead = EngineDeadError(f"the engine core did not answer a read ({what}): {exc}")
                if not self._stopping:
                    _end(self.proc)  # (a hung core must not keep decoding streams already failed)
                    self._die(dead)
                raise dead from None
        if reply["t"] == "err":
            raise wire.error_in(reply["e"])
        return reply["v"]

    def load(self) -> EngineLoad:
        """The core's load; once it is gone, the last one read (monitoring keeps answering)."""
        if self.alive:
            self._last_load = wire.load_in(self.read("load"))
        return self._last_load

    def stats(self) -> EngineStats:
        """The core's counters; once it is gone, the last ones read."""
        if self.alive:
            self._last_stats = EngineStats(**self.read("stats"))
        return self._last_stats

    def spec_outlook(self, streams: int) -> tuple[int | None, float]:
        k, per_step = self.read("spec_outlook", streams)
        return k, float(per_step)

    def prompt_left(self, request_id: str) -> int | None:
        return self.read("prompt_left", request_id)

    def prompts_left(self, request_ids: list[str]) -> dict[str, int | None]:
        """`prompt_left` of each request, in one round trip."""
        return dict(zip(request_ids, self.read("prompts_left", request_ids)))

    def predicted_prefill_budget(self, tokens: int, cached: int, streams: int, backlog: int) -> int | None:
        return self.read("predicted_prefill_budget", tokens, cached, streams, backlog)

    @property
    def in_flight(self) -> tuple[float, int, int, int] | None:
        v = self.read("in_flight") if self.alive else None
        return None if v is None else (float(v[0]), int(v[1]), int(v[2]), int(v[3]))

    def thread_cpu(self) -> dict[str, float]:
        """The core process's CPU seconds by thread group (common/thread_cpu.py); {} once it is gone."""
        return self.read("thread_cpu") if self.alive else {}

    @property
    def counters(self) -> dict:
        return self.read("counters") if self.alive else {}

    # -- requests --------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int,
               tenant: str | None = None, resume_ids: list[int] | None = None, remote_kv: bool = False,
               lora_request: LoRARequest | None = None) -> asyncio.Queue:
        if remote_kv:
            raise ValueError("engine_core_process: remote KV arrives beside the engine in one process")
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        self._send({"t": "add", "rid": request_id, "ids": list(prompt_ids), "params": wire.params_out(params),
                    "priority": int(priority), "tenant": tenant, "resume": resume_ids,
                    "lora": wire.lora_out(lora_request)})
        return q

    def abort(self, request_id: str) -> None:
        self._send({"t": "abort", "rid": request_id})

    def attach(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def detach(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def set_step_targets(self, cost, targets) -> None:
        self._send({"t": "plan", **wire.plan_out(cost, targets)})

    def set_prefill_token_budget(self, tokens: int | None) -> None:
        self._send({"t": "budget", "tokens": tokens})

    def call(self, fn: Callable) -> None:
        raise ValueError("engine_core_process: a call into the engine runs beside it in one process")

    def _send(self, msg: dict) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(wire.pack(msg))

    # -- what the core sends -------------------------------------------------------------------
    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = await wire.read(reader)
                t = msg["t"]
                if t == "step":
                    self._deliver_step(msg)
                elif t == "item":
                    self._deliver_item(msg)
                elif t == "dead":
                    err = msg["error"]
                    self._die(EngineDeadError(f"{err['kind']}: {err['message']}"))
                    return
        except (wire.WireError, ConnectionError, OSError) as exc:
            if not self._stopping:
                code = self.proc.poll()
                self._die(EngineDeadError(f"the engine-core process {self.proc.pid} is gone "
                                          f"({'exit code ' + str(code) if code is not None else exc})"))
        except Exception as exc:  # noqa: BLE001  (a frame this side cannot read: no stream may wait on)
            log.exception("engine core: a frame could not be read; the core is stopped")
            _end(self.proc)
            self._die(EngineDeadError(f"a frame from the engine core could not be read: {exc!r}"))

    def _deliver_step(self, msg: dict) -> None:
        for rid, d, f in msg["items"]:
            self._put(rid, wire.delta_in(d), wire.final_in(f))
        self.prefill_token_budget = msg["budget"]
        if self.on_step is not None:
            try:
                self.on_step(wire.info_in(msg["info"]))
            except Exception:  # noqa: BLE001  (as a failed callback of the event loop: logged, next step)
                log.exception("engine core: on_step failed")

    def _deliver_item(self, msg: dict) -> None:
        if "error" in msg:
            self._put(msg["rid"], wire.error_in(msg["error"]), None)
        else:
            self._put(msg["rid"], wire.delta_in(msg["delta"]), wire.final_in(msg["final"]))

    def _put(self, rid: str, item, final) -> None:
        q = self._streams.get(rid)
        if q is None:
            return
        q.put_nowait((item, final))
        if final is not None or isinstance(item, BaseException) or item.finished:
            del self._streams[rid]

    def _die(self, exc: BaseException) -> None:
        """Once: the first cause is the one reported (a read may see the wire break before the
        reader reads the core's own account of its death)."""
        if self.error is not None:
            return
        log.critical("engine core died: %s", exc)
        self.error = exc
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait((exc, None))
        if self.on_death is not None:
            try:
                self.on_death(exc)
            except Exception:  # noqa: BLE001
                log.exception("engine core: on_death failed")


class CoreEngineView:
    """What a decode worker reads of its engine when that runs in the core process."""

    kv_events = None  # (its log is in the core, which publishes it: `kv_event_endpoints`)

    def __init__(self, client: EngineCoreClient):
        ready = client.ready
        self._client = client
        self.connector = client.connector
        self.prompts = client.prompts
        self.config = SimpleNamespace(block_size=ready["block_size"], max_num_seqs=ready["max_num_seqs"],
                                      enable_lora=ready["enable_lora"], max_lora_rank=ready["max_lora_rank"],
                                      enable_prefix_caching=ready["enable_prefix_caching"])
        # (the API process checks a LoRA adapter's files against the model before serving it)
        self.model_config = ModelConfig.from_dir(client.model)
        self.max_model_len: int = ready["max_model_len"]
        # where the core publishes its KV events (the worker record's endpoints; {}: it records none)
        self.kv_event_endpoints: dict[str, str] = dict(ready["kv_events"])
        self.spec = SimpleNamespace() if ready["spec"] else None
        # the calibration steps the core timed before serving (engine/calibrate.py measure_steps)
        self.calibration = [(float(s[0]), int(s[1]), int(s[2]), int(s[3])) for s in ready["calibration"]]

    def load(self) -> EngineLoad:
        return self._client.load()

    @property
    def stats(self) -> EngineStats:
        return self._client.stats()

    @property
    def prefill_token_budget(self) -> int | None:
        return self._client.prefill_token_budget

    def grammar_stats(self) -> dict:
        return self._client.read("grammar_stats") if self._client.alive else {}

    def tier_stats(self) -> dict:
        return self._client.read("tier_stats") if self._client.alive else {}

    def close(self) -> None:
        """The core closes its engine when it stops (`EngineCoreClient.stop`)."""


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        _wait(proc, 5.0)
