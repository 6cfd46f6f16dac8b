"""`meridian bench real` against a local fake OpenAI-compatible streaming server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from meridian.bench.realmode import RealRunSpec, run_real
from meridian.cli import main
from meridian.sim.request import RequestKind, RequestSpec

THINK_DELTAS, ANSWER_DELTAS, GAP_S = 5, 4, 0.01


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams THINK_DELTAS reasoning deltas then ANSWER_DELTAS content deltas, GAP_S apart."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if request.get("model") != "tiny":
            self.send_response(404)
            self.end_headers()
            return
        no_think = request["messages"][0]["content"].endswith("/no_think")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(obj: object) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()
            time.sleep(GAP_S)

        for _ in range(0 if no_think else THINK_DELTAS):
            send({"choices": [{"delta": {"reasoning_content": "hm"}}]})
        for _ in range(ANSWER_DELTAS):
            send({"choices": [{"delta": {"content": "ok"}}]})
        send({"choices": [], "usage": {"completion_tokens": 9}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_phases_are_split_into_ttft_ttfvt_ttot_and_itl(server: str) -> None:
    specs = [
        RequestSpec("r0", 0, 10, 20, 10, RequestKind.REASONING),
        RequestSpec("r1", 20_000_000, 10, 0, 10, RequestKind.CHAT),
    ]
    result, errors, retried = run_real(RealRunSpec(url=server, model="tiny"), specs)
    assert errors == [] and retried == []
    think, chat = result.records
    assert think.num_think_tokens == THINK_DELTAS and think.num_answer_tokens == ANSWER_DELTAS
    assert think.first_token_ns is not None and think.first_answer_ns is not None
    assert think.think_end_ns is not None
    # TTFVT includes the think phase; TTOT is the gap after the last think delta.
    assert think.first_answer_ns - think.first_token_ns >= THINK_DELTAS * GAP_S * 1e9 * 0.8
    assert 0 < think.first_answer_ns - think.think_end_ns < 0.5e9
    assert len(think.answer_token_ns) == ANSWER_DELTAS
    gaps = [b - a for a, b in zip(think.answer_token_ns, think.answer_token_ns[1:], strict=False)]
    assert all(g >= GAP_S * 1e9 * 0.5 for g in gaps)
    assert chat.num_think_tokens == 0 and chat.think_end_ns is None
    assert chat.first_token_ns is not None and chat.first_token_ns >= 20_000_000


class ResettingOpenAI(FakeOpenAI):
    """Drops the connection of its first ``resets`` POSTs before sending any response."""

    resets = 0

    def do_POST(self) -> None:
        if ResettingOpenAI.resets > 0:
            ResettingOpenAI.resets -= 1
            self.rfile.read(int(self.headers["Content-Length"]))
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        super().do_POST()


@pytest.mark.parametrize(("resets", "failed"), [(2, 0), (3, 1)])
def test_connection_failures_before_a_response_are_sent_again(resets: int, failed: int) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ResettingOpenAI)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    ResettingOpenAI.resets = resets
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        specs = [RequestSpec("r0", 0, 10, 20, 10, RequestKind.REASONING)]
        result, errors, retried = run_real(RealRunSpec(url=url, model="tiny"), specs)
    finally:
        httpd.shutdown()
        httpd.server_close()
    # Two more attempts at most: two resets are absorbed, a third is a failure.
    assert len(retried) == 2 and all("before a response" in r for r in retried)
    assert len(errors) == failed
    assert result.records[0].finished == (failed == 0)
    if failed:
        assert "after 0 reasoning and 0 answer deltas" in errors[0]


def test_failures_are_reported_not_dropped(server: str) -> None:
    specs = [RequestSpec("r0", 0, 10, 0, 5, RequestKind.CHAT)]
    result, errors, retried = run_real(RealRunSpec(url=server, model="other"), specs)
    assert len(errors) == 1 and "HTTP 404" in errors[0] and retried == []
    assert len(result.records) == 1 and not result.records[0].finished


def test_cli_writes_a_valid_report(server: str, tmp_path: Path) -> None:
    args = [
        "bench",
        "real",
        "--url",
        server,
        "--model",
        "tiny",
        "--duration-s",
        "2",
        "--arrival-rate",
        "3",
        "--max-think-tokens",
        "64",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    summary = report["summaries"]["server"]
    assert summary["num_finished"] == summary["num_requests"] > 0
    assert summary["output_itl_s"]["p50"] >= GAP_S * 0.5
    assert report["offered"]["num_requests"] == summary["num_requests"]
    assert report["offered"]["rate_req_s"] == summary["num_requests"] / 2
    assert (tmp_path / "cdf-ttfvt.png").exists()


def test_unreachable_server_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["bench", "real", "--url", "http://127.0.0.1:9/v1", "--model", "x", "--duration-s", "1"]
        )
        == 2
    )
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err
