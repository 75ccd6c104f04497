"""Nothing secret leaves the process: a real program run with secret-looking options writes
none of their values into the trace file, the sidecar, the report, the summary or an
OpenTelemetry exporter; the options' names stay."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from copytrace._redact import DEFAULT_PATTERNS as DEFAULTS
from copytrace._redact import REDACTED, Redactor, redact_args

PROGRAM = """
import sys, torch
x = torch.ones(4)
for _ in range(2):
    y = x.clone()
    z = y.detach()
print("args", len(sys.argv))
"""

SECRETS = ["sk-SECRET1", "SECRET2", "SECRET3", "SECRET4", "SECRET5"]
ARGS = [
    "--api-key", "sk-SECRET1", "--password=SECRET2", "--db",
    "postgres://bob:SECRET3@db.example/x", "--url", "https://h.example/p?token=SECRET4&a=1",
    "trainer.secret=SECRET5", "--tokenizer", "gpt2", "--lr", "0.1",
]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _read_all(root: Path) -> str:
    """Every file under ``root`` as text (gzip files decompressed, Parquet files as bytes:
    the resource attributes sit in their key-value metadata, uncompressed)."""
    parts = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".gz":
                data = gzip.decompress(data)
            parts.append(data.decode("utf-8", "replace"))
    return "\n".join(parts)


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    exe = Path(sys.executable).with_name("copytrace")
    return subprocess.run(
        [str(exe), "run", "-o", str(tmp_path / "out"), str(prog), *ARGS],
        capture_output=True, text=True, env=_env(**env), cwd=tmp_path, timeout=240,
    )  # fmt: skip


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver on loopback: keeps the request bodies (protobuf: the strings
    of the attributes sit in it as they are)."""

    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server name
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_secret_values_never_leave_the_process(tmp_path):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = _run(
            tmp_path, OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
        )  # fmt: skip
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr
    assert f"args {1 + len(ARGS)}" in proc.stdout  # the program saw its own arguments
    out = tmp_path / "out"
    assert list(out.glob("*.otlp.jsonl*")) and (out / "report.html").exists()
    assert list(out.rglob("*.parquet")), "the sidecar"
    summary = subprocess.run(
        [str(Path(sys.executable).with_name("copytrace")), "summary", str(out)],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert summary.returncode == 0, summary.stderr
    written = _read_all(out)
    exported = b"".join(_Collector.bodies).decode("utf-8", "replace")
    assert "copytrace.run" in exported
    for secret in SECRETS:
        for where, text in (
            ("files", written),
            ("exporter", exported),
            ("summary", summary.stdout),
        ):
            assert secret not in text, (secret, where)
    for name in ("--api-key", "--password=", "trainer.secret=", "--db", "postgres://"):
        assert name in written and name in exported, name
    assert "gpt2" in written  # a tokenizer is not a token


def test_redact_0_keeps_the_values(tmp_path):
    proc = _run(tmp_path, COPYTRACE_REDACT="0", COPYTRACE_REPORT="0")
    assert proc.returncode == 0, proc.stderr
    written = _read_all(tmp_path / "out")
    assert all(secret in written for secret in SECRETS)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--api-key", "v"], ["--api-key", REDACTED]),
        (["--API_KEY=v"], [f"--API_KEY={REDACTED}"]),
        (["--auth-token", "--lr"], ["--auth-token", "--lr"]),  # no value: nothing to hide
        (["--author", "me", "--tokenizer", "t"], ["--author", "me", "--tokenizer", "t"]),
        (["https://u:p@h/x"], [f"https://{REDACTED}@h/x"]),
        (["--mirror=https://tok@h/x"], [f"--mirror=https://{REDACTED}@h/x"]),
        (["http://h/x?api_key=v&n=1"], [f"http://h/x?api_key={REDACTED}&n=1"]),
        (["a=b", "plain"], ["a=b", "plain"]),
    ],
)
def test_redactor_forms(argv, expected):
    assert Redactor(DEFAULTS).args(argv) == expected


def test_patterns_extend_the_defaults(monkeypatch):
    monkeypatch.setenv("COPYTRACE_REDACT_PATTERNS", "^dsn$,hf_")
    assert redact_args(["--dsn", "x", "--hf_home", "y", "--key", "z"]) == [
        "--dsn", REDACTED, "--hf_home", REDACTED, "--key", REDACTED,
    ]  # fmt: skip
    monkeypatch.setenv("COPYTRACE_REDACT", "0")
    assert redact_args(["--key", "z"]) == ["--key", "z"]
