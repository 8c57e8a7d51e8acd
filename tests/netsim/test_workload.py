"""The load driver against a stand-in server on loopback: complete and incomplete streams,
errors mid-stream, HTTP errors, silence, and the request mix."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from netsim import workload

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "meshagent": {"stage_ms": [1.0, 2.0]}}


def chunk(content=None, finish=None):
    delta = {"content": content} if content else {}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


FAILED = {"error": {"message": "the split pipeline failed", "code": "engine_error"}}
STREAMS = {
    "complete": [chunk("Hel"), chunk("lo"), chunk(finish="stop"), {"choices": [], "usage": USAGE}],
    "no-done": [chunk("Hel"), chunk(finish="length")],
    "error": [chunk("Hel"), FAILED],
}
STREAMS["complete"].append("[DONE]")


class Handler(BaseHTTPRequestHandler):
    mode = "complete"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = Handler.mode
        if mode == "http-503":
            data = json.dumps({"error": {"message": "busy", "code": "peer_unavailable"}}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if mode == "silent":
            threading.Event().wait(2)
            return
        if not body["stream"]:
            data = json.dumps(
                {
                    "choices": [{"message": {"content": "Hello"}, "finish_reason": "stop"}],
                    "usage": USAGE,
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-meshagent-stages", "a:0-10,b:10-30")
            self.end_headers()
            self.wfile.write(data)
            return
        assert body["stream_options"] == {"include_usage": True}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for ev in STREAMS[mode]:
            payload = ev if isinstance(ev, str) else json.dumps(ev)
            self.wfile.write(f"data: {payload}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server.server_address[1]
    server.shutdown()


def run(port: int, mode: str, stream: bool = True, timeout: float = 5.0) -> dict:
    Handler.mode = mode
    spec = workload.RequestSpec(0, "short", stream, "hi", 16, 0.0, 1)
    return workload.run_one(port, "m", spec, timeout)


def test_a_complete_stream_is_ok_with_its_chunks_usage_and_receipt(port):
    r = run(port, "complete")
    assert r["ok"] and r["complete"] and r["done"] and r["finish_reason"] == "stop"
    assert len(r["chunks"]) == 2 and r["t_first"] == r["chunks"][0]
    assert r["completion_tokens"] == 2 and r["stage_ms"] == [1.0, 2.0]
    assert r["text_chars"] == 5 and r["error"] is None


def test_a_whole_response_is_ok_with_its_receipt(port):
    r = run(port, "complete", stream=False)
    assert r["ok"] and r["finish_reason"] == "stop" and r["stages"] == "a:0-10,b:10-30"
    assert r["stage_ms"] == [1.0, 2.0] and r["chunks"] == []


def test_a_stream_without_done_is_incomplete(port):
    r = run(port, "no-done")
    assert not r["ok"] and r["cause"] == "incomplete" and "[DONE]" in r["error"]
    assert r["finish_reason"] == "length"


def test_an_error_event_mid_stream_is_a_stream_error(port):
    r = run(port, "error")
    assert not r["ok"] and r["cause"] == "stream_error"
    assert "engine_error" in r["error"] and "the split pipeline failed" in r["error"]
    assert len(r["chunks"]) == 1


def test_an_http_error_carries_its_code_and_message(port):
    r = run(port, "http-503")
    assert not r["ok"] and r["cause"] == "http" and r["status"] == 503
    assert r["error"] == "HTTP 503 peer_unavailable: busy"


def test_silence_is_a_timeout_and_a_closed_port_a_connect_failure(port):
    r = run(port, "silent", timeout=0.3)
    assert not r["ok"] and r["cause"] == "timeout"
    spec = workload.RequestSpec(0, "short", True, "hi", 16, 0.0, 1)
    closed = workload.run_one(1, "m", spec, 1.0)
    assert not closed["ok"] and closed["cause"] == "connect"


def test_the_soak_mix_is_balanced_in_blocks_and_repeatable():
    specs = [workload.request_spec("soak", i, seed=1) for i in range(200)]
    kinds = Counter((s.shape, s.stream) for s in specs)
    assert set(kinds.values()) == {50}
    for b in range(0, 200, 4):  # every block of 4 holds each kind once
        assert len({(s.shape, s.stream) for s in specs[b : b + 4]}) == 4
    assert specs == [workload.request_spec("soak", i, seed=1) for i in range(200)]
    assert specs != [workload.request_spec("soak", i, seed=2) for i in range(200)]
    assert workload.request_spec("count", 0, 1, max_tokens=1).max_tokens == 1
    assert workload.request_spec("count", 0, 1).temperature == 0.0


def test_a_request_can_ask_for_a_speculation_mode():
    spec = workload.request_spec("copy", 0, seed=1)
    assert spec.shape == "copy" and spec.temperature == 0.0 and "9400" in spec.prompt
    assert "meshagent" not in json.loads(workload._body(spec, "m"))
    asked = dataclasses.replace(spec, speculation="off")
    assert json.loads(workload._body(asked, "m"))["meshagent"] == {"speculation": "off"}


def test_the_speculation_workloads_are_greedy_and_the_code_one_edits_a_function():
    for mix in ("copy", "code", "prose"):
        spec = workload.request_spec(mix, 0, 1)
        assert spec.temperature == 0.0 and spec.stream and spec.max_tokens == 128
    code = workload.request_spec("code", 0, 1)
    assert "def summarize" in code.prompt and "running_sum" in code.prompt
