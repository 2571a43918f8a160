"""bench/peer_ttft.py without vLLM: its client against a streaming HTTP server, and its table."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.bench.peer_ttft import format_table, probe


def test_probe_sends_each_length_its_own_prompts_and_times_the_first_chunk():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got = probe(f"http://127.0.0.1:{server.server_address[1]}", [3, 5], reps=2, warmup=1, gap_s=0.0,
                    vocab=1000, seed=0)
    finally:
        server.shutdown()
        server.server_close()
    assert {k: len(v) for k, v in got.items()} == {"3": 2, "5": 2}  # the warm-up request is dropped
    assert all(t > 0 for v in got.values() for t in v)
    assert [len(b["prompt"]) for b in seen] == [3, 3, 3, 5, 5, 5]
    assert len({tuple(b["prompt"]) for b in seen}) == 6  # no two requests share a prompt (no prefix cache)
    assert all(b["max_tokens"] == 1 and b["stream"] for b in seen)


def test_the_table_gives_each_systems_median_and_vllms_over_it():
    doc = {"config": {"lengths": [100, 950]}, "results": {
        "vllm": {"100": [20.0, 22.0, 30.0], "950": [70.0, 73.0, 75.0]},
        "colocated": {"100": [15.0, 15.0, 16.0], "950": [90.0, 96.0, 110.0]}}}
    table = format_table(doc)
    assert "| 100 | 22.0 [20.0-30.0] | 15.0 [15.0-16.0] | 1.47x |" in table
    assert "| 950 | 73.0 [70.0-75.0] | 96.0 [90.0-110.0] | 0.76x |" in table
