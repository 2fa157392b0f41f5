"""The server's network safety (serving/security.py) and `speculor serve`'s llama-server command line, on the tiny
random pair (support/server.py), live on 127.0.0.1: a missing, wrong and right API key on every route (/health open);
bodies over the limit refused as they arrive, declared or chunked; a client that sends slowly is cut off without
reaching the scheduler and blocks nobody; a client that does not read its stream is cut off and its generation
cancelled; TLS; Ray Serve's ingress gets the same guard; llama-server's flags: its spellings parsed into our settings,
any other refused by name."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from support.server import live_server, tiny_pair, wait_for

from speculor import Pair, cli, commands
from speculor.errors import SpeculorError
from speculor.serving.app import create_app
from speculor.serving.security import Guard, read_keys, warn_if_exposed

KEYS = ("key-one", "key-two")
LIMIT = 4096  # the test server's body limit, bytes
TIMEOUT = 1.5  # the test server's body and write deadline, seconds
ROUTES = [  # (method, path, body) of every route; a body that the route answers 200 with
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("GET", "/metrics", None),
    ("POST", "/completion", {"prompt": "Hello", "n_predict": 2, "temperature": 0}),
    ("POST", "/completions", {"prompt": "Hello", "n_predict": 2, "temperature": 0}),
    ("POST", "/tokenize", {"content": "Hello"}),
    ("POST", "/detokenize", {"tokens": [74, 75]}),
    ("GET", "/props", None),
]


@pytest.fixture(scope="module")
def pair() -> Pair:
    return tiny_pair()


@pytest.fixture(scope="module")
def app(pair: Pair):
    return create_app(pair, strategy="chain", guard=Guard(KEYS, max_body_bytes=LIMIT, timeout=TIMEOUT))


@pytest.fixture(scope="module")
def url(app) -> Iterator[str]:
    with live_server(app) as base:
        yield base


def ask(url: str, method: str, path: str, body, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def sample(metrics, name: str, **labels: str) -> float:
    """A sample of an app's metrics (its Prometheus text), 0 where absent."""
    text = metrics.render().body.decode()
    return next((s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                 if s.name == name and s.labels == labels), 0.0)


def raw(url: str, head: str, body: bytes = b"") -> socket.socket:
    """A socket to the server that has sent `head` (the request line and headers, CRLF-separated) and `body`."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    return sock


def response_of(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one response on `sock` (the server closes the connection after it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# ------------------------------------------------------------------------------------------------------- API keys


@pytest.mark.parametrize("method, path, body", ROUTES + [("GET", "/nowhere", None)])
def test_every_route_but_health_needs_a_right_key(url: str, method: str, path: str, body, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-one"},
                    {"Authorization": "Bearer key-one-and-more"}, {"X-Api-Key": "key-on"}):
        r = ask(url, method, path, body, headers)
        assert r.status_code == 401, (headers, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    for headers in ({"Authorization": "Bearer key-one"}, {"authorization": "bearer key-two"}, {"X-Api-Key": "key-two"}):
        r = ask(url, method, path, body, headers)
        assert r.status_code == (404 if path == "/nowhere" else 200), (headers, r.text)
    assert not any(k in caplog.text for k in KEYS)  # no key is ever logged


def test_health_is_open(url: str) -> None:
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_keys_are_read_from_flags_and_a_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# the team's keys\nalpha\n\n  beta  \n#gamma\n")
    assert read_keys(["one,two", "three"], str(f)) == ("one", "two", "three", "alpha", "beta")
    assert read_keys() == ()
    for keys, key_file, match in ((["a,,b"], None, "empty key"), ([], str(tmp_path / "none"), "api-key-file"),
                                  ([], str(tmp_path), "api-key-file")):
        with pytest.raises(SpeculorError, match=match):
            read_keys(keys, key_file)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(SpeculorError, match="holds no key"):
        read_keys([], str(tmp_path / "empty"))
    assert "alpha" not in repr(Guard(("alpha",)))


def test_a_host_beyond_the_loopback_without_a_key_is_warned_about(caplog) -> None:
    caplog.set_level(logging.WARNING, "speculor.serving.app")
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        warn_if_exposed(host, Guard())
    warn_if_exposed("0.0.0.0", Guard(("k",)))
    assert not caplog.records
    warn_if_exposed("0.0.0.0", Guard())
    warn_if_exposed("192.168.1.5", Guard())
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert "without an API key" in caplog.records[0].getMessage()


# --------------------------------------------------------------------------------------------------- body limit


def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(url: str) -> None:
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\n" \
           "Content-Type: application/json\r\nContent-Length: 1000000000"
    t0 = time.monotonic()
    status, body = response_of(raw(url, head))  # not a byte of the body sent
    assert status == 413 and body["error"]["code"] == "request_too_large" and "4096 bytes" in body["error"]["message"]
    assert time.monotonic() - t0 < TIMEOUT  # refused at once, not after the body's deadline
    r = ask(url, "POST", "/tokenize", {"content": "x" * (LIMIT + 10)}, {"Authorization": "Bearer key-one"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(url: str) -> None:
    """The body's first LIMIT + 1 bytes arrive, then nothing: the 413 comes without waiting for the rest (a 408 would
    mean the server waited for the whole body)."""
    part = b"x" * (LIMIT + 1)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\nTransfer-Encoding: chunked"
    status, body = response_of(raw(url, head, f"{len(part):x}\r\n".encode() + part + b"\r\n"))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    r = httpx.post(url + "/tokenize", content=iter([b'{"content": "', b"y" * LIMIT, b'"}']),
                   headers={"Authorization": "Bearer key-one"}, timeout=30)
    assert r.status_code == 413
    r = httpx.post(url + "/tokenize", content=iter([b'{"content": ', b'"yes"}']), timeout=30,
                   headers={"Authorization": "Bearer key-one", "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"]  # a chunked body within the limit is read whole


# -------------------------------------------------------------------------------------------------- slow clients


def test_a_slow_sender_is_cut_off_and_blocks_nobody(app, url: str) -> None:
    """A client sends its body a byte at a time: others' requests complete meanwhile, it never reaches the
    scheduler, and it gets a 408 at the deadline."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}")
    sock = raw(url, head)
    result: dict = {}

    def trickle() -> None:
        t0 = time.monotonic()
        try:
            for b in body:
                sock.sendall(bytes([b]))
                time.sleep(0.2)
        except OSError:  # cut off
            pass
        result["answer"], result["after"] = response_of(sock), time.monotonic() - t0

    thread = threading.Thread(target=trickle)
    metrics = app.state.server.metrics
    generations = sample(metrics, "speculor_generations_total", outcome="completed")
    t0 = time.monotonic()
    thread.start()
    r = ask(url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0},
            {"Authorization": "Bearer key-two"})  # while it trickles
    other = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    thread.join(30)
    status, error = result["answer"]
    assert status == 408 and error["error"]["code"] == "request_timeout"
    assert result["after"] >= TIMEOUT and other < result["after"]  # cut at the deadline; the other answered first
    assert sample(metrics, "speculor_generations_total", outcome="completed") == generations + 1  # only the other


def test_a_client_that_does_not_read_its_stream_is_cut_off_and_its_generation_cancelled(pair: Pair, caplog) -> None:
    """The app called as uvicorn calls it, with a client whose writes block after the first chunk (its buffers
    full): the call ends at the deadline and the generation leaves the batch, cancelled, long before its
    max_tokens."""
    app = create_app(pair, strategy="chain", guard=Guard(timeout=0.5))
    srv = app.state.server
    body = json.dumps({"prompt": "Hello", "max_tokens": 3000, "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never hangs up

    async def send(message: dict) -> None:
        sent.append(message)
        if len([m for m in sent if m["type"] == "http.response.body"]) > 1:
            await asyncio.Event().wait()  # the client reads no more

    async def call() -> float:
        t0 = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), 30)
        return time.monotonic() - t0

    caplog.set_level(logging.WARNING, "speculor.serving.app")
    seconds = asyncio.run(call())
    assert sent[0]["status"] == 200 and seconds < 10
    assert "did not read its response for 0.5 s: cut off" in caplog.text
    wait_for(lambda: srv.scheduler.size() == 0, "the generation to leave the batch")
    assert sample(srv.metrics, "speculor_generations_total", outcome="cancelled") == 1
    assert sample(srv.metrics, "speculor_generated_tokens_total") < 3000
    srv.scheduler.stop()


# ----------------------------------------------------------------------------------------------------------- TLS


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A key and a self-signed certificate for 127.0.0.1 (PEM files)."""
    pytest.importorskip("cryptography")
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = folder / "key.pem", folder / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


def test_tls_through_uvicorns_options(pair: Pair, tmp_path: Path, monkeypatch, caplog) -> None:
    """`serve` hands the key and certificate to uvicorn (and warns about 0.0.0.0 without a key); uvicorn with them
    answers over HTTPS with the guard in front."""
    from speculor.serving import app as app_module

    key_file, cert_file = self_signed(tmp_path)
    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    monkeypatch.setattr(app_module, "warm_up", lambda pair: None)
    caplog.set_level(logging.WARNING, "speculor.serving.app")
    app_module.serve(pair, host="0.0.0.0", ssl_keyfile=str(key_file), ssl_certfile=str(cert_file))
    assert runs[0]["ssl_keyfile"] == str(key_file) and runs[0]["ssl_certfile"] == str(cert_file)
    assert "without an API key" in caplog.text
    with pytest.raises(SpeculorError, match="both"):
        app_module.serve(pair, ssl_keyfile=str(key_file))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(pair, strategy="chain", guard=Guard(("tls-key",)))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ssl_keyfile=str(key_file),
                                           ssl_certfile=str(cert_file)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "the TLS server")
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=str(cert_file), timeout=30) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert c.get("/props").status_code == 401
            assert c.get("/props", headers={"Authorization": "Bearer tls-key"}).json()["total_slots"] == 16
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


# ---------------------------------------------------------------------------------------------------- Ray Serve


def test_ray_serves_ingress_gets_the_same_guard() -> None:
    """The ingress deployment is bound with the settings' Guard and builds its app with it (no Ray instance)."""
    pytest.importorskip("ray")
    from speculor.serving.metrics import Metrics
    from speculor.serving.ray_config import RaySettings
    from speculor.serving.ray_serve import Ingress, application

    s = RaySettings.of({"api_keys": ["ray-key"], "max_body_bytes": 100, "timeout": 3})
    assert "ray-key" not in repr(s) and "api_keys" not in s.replica_args()
    guard = application(s)._bound_deployment.init_args[-1]
    assert guard == Guard(("ray-key",), 100, 3.0)
    ingress = types.SimpleNamespace(service=types.SimpleNamespace(model="m"), guard=guard)
    ingress.service.metrics = Metrics()
    app = Ingress.func_or_class.__serve_build_asgi_app__(ingress)
    from starlette.testclient import TestClient

    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer ray-key"}).json()["data"][0]["id"] == "m"
        r = c.post("/v1/completions", content=b"x" * 200, headers={"Authorization": "Bearer ray-key"})
        assert r.status_code == 413


# ---------------------------------------------------------------------------------------- llama-server's flags

LLAMA_LINE = "-m target.gguf -md draft.gguf -c 8192 -np 4 -t 2 --port 8080 --jinja"
OURS = "--target target.gguf --draft draft.gguf --context 8192 --max-batch 4 --threads 2 --port 8080"


@pytest.fixture
def no_pair(monkeypatch):
    def load(args):
        raise AssertionError("the model pair was loaded")

    monkeypatch.setattr(commands, "load", load)


def test_the_llama_server_command_line_is_our_settings() -> None:
    ap = cli._parser()
    theirs, ours = vars(ap.parse_args(["serve", *LLAMA_LINE.split()])), vars(ap.parse_args(["serve", *OURS.split()]))
    assert {k: v for k, v in theirs.items() if ours[k] != v} == {"jinja": True}
    spec = commands.pair_spec(ap.parse_args(["serve", *LLAMA_LINE.split()]))
    assert (spec.target, spec.draft, spec.context, spec.threads) == ("target.gguf", "draft.gguf", 8192, 2)
    long = ap.parse_args("serve --model a.gguf --model-draft b.gguf --ctx-size 2048 --parallel 3 --threads 1 "
                         "-tb 1 --n-predict 7 --alias m --api-key k --timeout 9 --ssl-key-file x --ssl-cert-file y"
                         .split())
    assert (long.target, long.draft, long.context, long.max_batch, long.threads_batch, long.n_predict, long.alias,
            long.api_key, long.timeout, long.ssl_keyfile, long.ssl_certfile) == \
        ("a.gguf", "b.gguf", 2048, 3, 1, 7, "m", ["k"], 9.0, "x", "y")


def test_serve_gets_the_llama_server_settings(monkeypatch, tmp_path: Path) -> None:
    pair = object()
    monkeypatch.setattr(commands, "load", lambda args: pair)
    served = []
    fake = types.ModuleType("speculor.serving.app")
    fake.serve = lambda pair, **kw: served.append(kw)
    monkeypatch.setitem(sys.modules, "speculor.serving.app", fake)
    (tmp_path / "keys").write_text("k2\n")
    argv = ["serve", *LLAMA_LINE.split(), "-n", "64", "-a", "coder", "--api-key", "k1", "--api-key-file",
            str(tmp_path / "keys"), "-to", "30", "--ssl-key-file", "key.pem", "--ssl-cert-file", "cert.pem"]
    assert cli.main(argv) == 0
    kw = served[0]
    assert (kw["port"], kw["max_batch"], kw["n_predict"], kw["model"], kw["ssl_keyfile"], kw["ssl_certfile"]) == \
        (8080, 4, 64, "coder", "key.pem", "cert.pem")
    assert kw["guard"] == Guard(("k1", "k2"), timeout=30.0)
    assert cli.main(["serve", *LLAMA_LINE.split(), "-n", "-1"]) == 0 and "n_predict" not in served[1]


@pytest.mark.parametrize("argv, flag", [
    (["-ngl", "99"], "-ngl"), (["--n-gpu-layers", "99"], "--n-gpu-layers"), (["-fa", "on"], "-fa"),
    (["--flash-attn=on"], "--flash-attn"), (["--cont-batching"], "--cont-batching"), (["-b", "512"], "-b"),
    (["-ub", "256"], "-ub"), (["--mlock"], "--mlock"), (["--spec-type", "ngram-mod"], "--spec-type"),
    (["--spec-draft-n-max", "8"], "--spec-draft-n-max"), (["--draft-max", "8"], "--draft-max"),
    (["-ctk", "q8_0"], "-ctk"), (["--cache-type-k", "q8_0"], "--cache-type-k"), (["--temp", "0"], "--temp"),
    (["--slots"], "--slots"), (["--metrics"], "--metrics"), (["--no-jinja"], "--no-jinja"), (["-s", "1"], "-s"),
])
def test_a_llama_server_flag_we_do_not_honour_is_refused_by_name(argv, flag, no_pair, capsys) -> None:
    assert cli.main(["serve", *LLAMA_LINE.split(), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"speculor: error: {flag} is a llama-server flag that `speculor serve` does not honour")
    assert "Traceback" not in err


def test_a_value_that_looks_like_a_flag_is_a_value(monkeypatch) -> None:
    served = []
    monkeypatch.setattr(commands, "load", lambda args: None)
    fake = types.ModuleType("speculor.serving.app")
    fake.serve = lambda pair, **kw: served.append(kw)
    monkeypatch.setitem(sys.modules, "speculor.serving.app", fake)
    assert cli.main(["serve", "--api-key=-fa", "--alias=--metrics"]) == 0
    assert served[0]["guard"].api_keys == ("-fa",) and served[0]["model"] == "--metrics"


@pytest.mark.parametrize("argv, message", [
    (["-t", "2", "-tb", "4"], "-tb/--threads-batch 4"), (["-n", "0"], "-n/--n-predict"),
    (["--ssl-key-file", "k.pem"], "TLS needs both"), (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--timeout", "0"], "--timeout"),
])
def test_bad_server_options_are_refused_before_loading(argv, message, no_pair, capsys) -> None:
    assert cli.main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
