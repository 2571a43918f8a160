"""What a simulation is run on and what it records: the topology (`SimTopology`) and one
request's outcome (`RequestRecord`, what sim/report.py summarises)."""

from __future__ import annotations

from dataclasses import dataclass

INGRESS = ("round_robin", "random", "gateway")


@dataclass(frozen=True)
class SimTopology:
    """How many workers of each role, their tensor-parallel sizes, and how requests get in."""

    prefill: int = 0
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    ingress: str = "round_robin"  # round_robin | random | gateway (gateway/pick.py, by predicted TTFT)

    def __post_init__(self):
        if self.decode < 1 or self.prefill < 0:
            raise ValueError(f"a topology needs decode >= 1 and prefill >= 0 (got {self.prefill}P{self.decode}D)")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("tensor-parallel sizes must be >= 1")
        if self.ingress not in INGRESS:
            raise ValueError(f"ingress must be one of {', '.join(INGRESS)} (got {self.ingress!r})")

    @property
    def label(self) -> str:
        if self.prefill == 0:
            tp = "" if self.decode_tp == 1 else f" (TP {self.decode_tp})"
        else:
            tp = "" if self.prefill_tp == self.decode_tp == 1 else f" (TP {self.prefill_tp}/{self.decode_tp})"
        return f"{self.prefill}P{self.decode}D{tp}"

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp


@dataclass
class RequestRecord:
    """What happened to one request (sim/report.py summarises them)."""

    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    priority: str
    worker: str = ""
    refused: str | None = None  # the admission's reason code when refused
    held_since: float | None = None  # held for KV room (qos.kv_full_wait_ms) from then
    route: str = ""
    reason: str = ""
    predicted_ttft_ms: float = 0.0  # the route taken's
    predicted_local_ms: float = 0.0  # both routes' predictions, as a real worker's breakdown gives them
    predicted_remote_ms: float = 0.0
    cached_len: int = 0
    remote_cached_len: int = 0  # the most a prefill worker held of its prompt at admission (the hint)
    tier_cached_len: int = 0  # what its decode worker's second tier held past cached_len then
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    max_itl_ms: float = 0.0
    fell_back: bool = False
