"""OTLP export against a real backend: Arize Phoenix, started by the test on loopback.

Integration test (``pytest -m integration``): needs the ``otlp`` extra
(``opentelemetry-exporter-otlp-proto-http``; ``otlp-grpc`` for the gRPC case) and Phoenix in
its own virtual environment, ``.venv-phoenix`` at the repository root (or the ``phoenix``
executable named by ``$COPYTRACE_PHOENIX``); skipped when one is missing, or failed when
``COPYTRACE_REQUIRE_INTEGRATION=1`` (CI sets it, so that the tests cannot silently skip). Phoenix serves OTLP/HTTP at
``/v1/traces`` (and OTLP/gRPC on its gRPC port), files spans under the project named by the
resource attribute ``openinference.project.name``, and returns them from its REST API at
``/v1/projects/<project>/spans``. The spans read back must be the spans of the trace file:
same trace id, span ids, parents, names and attribute values.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _require import require_or_skip

import copytrace
from copytrace.dashboards import load_trace

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


def _phoenix_exe() -> str | None:
    exe = os.environ.get("COPYTRACE_PHOENIX") or str(ROOT / ".venv-phoenix" / "bin" / "phoenix")
    return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else shutil.which(exe)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now: all bound at once while chosen (one socket bound and
    closed after another can be given the same port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


class Phoenix:
    def __init__(self, exe: str, workdir: Path) -> None:
        self.port, self.grpc_port = _free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env.update(
            PHOENIX_WORKING_DIR=str(workdir),
            PHOENIX_HOST="127.0.0.1",
            PHOENIX_PORT=str(self.port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_TELEMETRY_ENABLED="false",
        )
        self.log = open(workdir / "phoenix.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [exe, "serve"], env=env, cwd=workdir, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 180.0) -> bool:
        """True once it answers; False when it exited first (a port it was given may have
        been taken by another process in between: the caller starts another); fails the
        test when it neither answers nor exits within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                return False
            if _get(self.url + "/healthz")[0] == 200:
                return True
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"phoenix did not become ready at {self.url}:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def spans(self, project: str, expected: int, timeout: float = 60.0) -> list[dict]:
        """All spans of ``project``, once ``expected`` of them are there (ingestion is async)."""
        deadline = time.monotonic() + timeout
        spans: list[dict] = []
        while time.monotonic() < deadline:
            spans, cursor = [], None
            while True:
                url = f"{self.url}/v1/projects/{project}/spans?limit=1000"
                if cursor:
                    url += f"&cursor={cursor}"
                status, body = _get(url)
                if status != 200:
                    break
                page = json.loads(body)
                spans.extend(page.get("data", []))
                cursor = page.get("next_cursor")
                if not cursor:
                    break
            if len(spans) >= expected:
                return spans
            time.sleep(0.5)
        return spans

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _missing(what: str) -> None:
    """Skip, or fail where CI says the integration tests must run."""
    require_or_skip(what)


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError:
        _missing("the otlp extra is not installed (pip install -e '.[otlp]')")
    exe = _phoenix_exe()
    if exe is None:
        _missing("Phoenix is not installed (.venv-phoenix, or $COPYTRACE_PHOENIX)")
    for _ in range(3):
        server = Phoenix(exe, tmp_path_factory.mktemp("phoenix"))
        if server.wait_ready():
            break
    else:
        pytest.fail(f"phoenix exited before it was ready, 3 times:\n{server.log_tail()}")
    yield server
    server.stop()


def _file_spans(path: Path) -> dict[str, dict]:
    """span id -> {trace, parent, name, attrs} from the trace file."""
    out = {}
    run = load_trace(path).runs[0]
    for s in run.steps:
        out[s.span_id] = {"name": "copytrace.step", "attrs": s.attrs}
    for e in run.events:
        out[e.span_id] = {"name": e.name, "parent": e.parent_id, "attrs": e.attrs}
    return out


_COMPARED = (
    "copytrace.step",
    "copytrace.bytes_allocated",
    "copytrace.alias",
    "copytrace.shape",
    "copytrace.aten",
    "copytrace.group",
    "code.line.number",
    "code.function.name",
)


def _dotted(attrs: dict, key: str) -> Any:
    """``attrs[key]``, whether the backend keeps dotted keys flat or nests them."""
    if key in attrs:
        return attrs[key]
    for part in key.split("."):
        attrs = attrs[part]
    return attrs


def _expected(path: Path) -> int:
    """Spans the backend must get: the file's steps and events, its run span and its
    hazards span (the programs below deep-copy a module every step: deepcopy-in-loop)."""
    (run,) = load_trace(path).runs
    assert run.hazards
    return len(_file_spans(path)) + 2


def _compare(file_path: Path, spans: list[dict]) -> None:
    data = load_trace(file_path)
    (run,) = data.runs
    expected = _file_spans(file_path)
    got = {s["context"]["span_id"]: s for s in spans}
    assert {s["context"]["trace_id"] for s in spans} == {run.trace_id}
    assert set(expected) <= set(got)
    names = [s["name"] for s in spans]
    assert names.count("copytrace.run") == 1
    assert len(spans) == len(expected) + 2  # + the run span and the hazards span
    # the hazards span reached the backend as it is in the file: under the run span, one
    # copytrace.hazard event per finding
    (hz,) = [s for s in spans if s["name"] == "copytrace.hazards"]
    (run_span,) = [s for s in spans if s["name"] == "copytrace.run"]
    assert hz["parent_id"] == run_span["context"]["span_id"]
    assert _dotted(hz["attributes"], "copytrace.hazards") == len(run.hazards)
    codes = [_dotted(e["attributes"], "copytrace.hazard.code") for e in hz.get("events", [])]
    assert codes == [h["copytrace.hazard.code"] for h in run.hazards]
    assert "deepcopy-in-loop" in codes
    for sid, exp in expected.items():
        span = got[sid]
        assert span["name"] == exp["name"]
        if "parent" in exp:
            assert span["parent_id"] == exp["parent"]
        for key in _COMPARED:
            if key in exp["attrs"]:
                assert span["attributes"].get(key) == exp["attrs"][key], (key, span, exp)


def _program(t) -> None:
    x = torch.randn(100, requires_grad=True)
    lin = torch.nn.Linear(4, 4)
    import copy

    for _ in range(5):
        x.clone()
        x.detach()
        copy.deepcopy(lin)
        t.step()


def test_otlp_http_exporter_from_the_api(phoenix, tmp_path, monkeypatch):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    project = f"copytrace-api-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"openinference.project.name={project}")
    exporter = OTLPSpanExporter(endpoint=phoenix.url + "/v1/traces")
    with copytrace.trace(tmp_path, exporters=[exporter], flush_events=4) as t:
        _program(t)
    spans = phoenix.spans(project, _expected(t.trace_path))
    _compare(t.trace_path, spans)


def _run_env_program(tmp_path: Path, **env: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import copy, torch
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(6):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                copy.deepcopy(model)
                torch.ones(3).clone()
            """
        )
    )
    out = tmp_path / "out"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    full.update(COPYTRACE="1", COPYTRACE_OUTPUT=str(out), COPYTRACE_REPORT="0", **env)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=full, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    assert "copytrace:" not in proc.stderr or "cannot" not in proc.stderr, proc.stderr
    (path,) = out.glob("*.otlp.jsonl*")
    return path


def test_otlp_http_from_standard_env_vars_with_no_code_change(phoenix, tmp_path):
    project = f"copytrace-env-{uuid.uuid4().hex[:8]}"
    path = _run_env_program(
        tmp_path,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=phoenix.url,  # the exporter appends /v1/traces
        OTEL_SERVICE_NAME="charlm",
        OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={project}",
    )
    spans = phoenix.spans(project, _expected(path))
    _compare(path, spans)


def test_otlp_grpc_from_env(phoenix, tmp_path):
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError:
        _missing("the otlp-grpc extra is not installed (pip install -e '.[otlp-grpc]')")
    project = f"copytrace-grpc-{uuid.uuid4().hex[:8]}"
    path = _run_env_program(
        tmp_path,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{phoenix.grpc_port}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={project}",
    )
    _compare(path, phoenix.spans(project, _expected(path)))
