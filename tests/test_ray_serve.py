"""speculor on Ray Serve, on a local Ray instance with tiny models (support/server.py's pair saved as folders, loaded
by each replica the way a user's models are): two replicas behind the ingress, driven by the real openai client, every
answer checked against the single-process server (`create_app` on the same folders); bad input; a replica killed
mid-stream by its process id; Ray's metrics; a scale-down that drains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from support.server import live_server, save_tiny_pair, wait_for

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.exceptions import ActorDiedError, RayTaskError  # noqa: E402

from speculor import SpeculorError, load_pair  # noqa: E402
from speculor.bench import loadtest  # noqa: E402
from speculor.serving.app import create_app  # noqa: E402
from speculor.serving.ray_config import RaySettings, check_fits  # noqa: E402
from speculor.serving.ray_serve import REPLICA_HEADER, application, replica_states  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
METRICS_PORT = 18_097


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny"))


def settings(folders: tuple[Path, Path], **kw) -> RaySettings:
    return RaySettings(target=str(folders[0]), draft=str(folders[1]), strategy="chain", threads=1, max_batch=2,
                       queue_size=2, replica_cpus=0.5, **kw)


@pytest.fixture(scope="module")
def ray_url(folders) -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=METRICS_PORT, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 500})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 18_098})
        serve.run(application(settings(folders, replicas=2)), name="speculor", route_prefix="/")
        yield "http://127.0.0.1:18098"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def direct_url(folders) -> Iterator[str]:
    """`speculor serve` in this process on the same folders, strategy and batch size."""
    pair = load_pair(str(folders[0]), str(folders[1]), threads=1)
    with live_server(create_app(pair, strategy="chain", queue_size=8, max_batch=2)) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


REQUESTS = [  # (chat, stream, body)
    (False, False, {"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0}),
    (False, True, {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}),
    (True, False, {"messages": [{"role": "user", "content": "Hello, world!"}], "max_tokens": 24, "temperature": 0}),
    (True, True, {"messages": [{"role": "user", "content": "How are you?"}], "max_tokens": 24, "temperature": 0}),
    (False, True, {"prompt": "Speculative decoding", "max_tokens": 24, "temperature": 0.8, "seed": 7}),
    (True, False, {"messages": [{"role": "user", "content": "lazy dog"}], "max_tokens": 24, "temperature": 0.9,
                   "top_p": 0.9, "seed": 3}),
    (False, False, {"prompt": "Hello", "max_tokens": 16, "temperature": 0.7, "seed": 11, "n": 2}),
    (True, True, {"messages": [{"role": "user", "content": "drafts tokens"}], "max_tokens": 24, "temperature": 0}),
]


def ask(url: str, chat: bool, stream: bool, body: dict) -> tuple[list[str], str]:
    """(each choice's text, the replica that answered) through the openai client."""
    api = client(url).chat.completions if chat else client(url).completions
    if stream:
        with api.with_streaming_response.create(model="x", stream=True, **body) as resp:
            texts: dict[int, str] = {}
            for chunk in resp.parse():
                for c in chunk.choices:
                    part = (c.delta.content if chat else c.text) or ""
                    texts[c.index] = texts.get(c.index, "") + part
            return [texts[i] for i in sorted(texts)], resp.headers.get(REPLICA_HEADER, "")
    raw = api.with_raw_response.create(model="x", **body)
    out = raw.parse()
    return [c.message.content if chat else c.text for c in out.choices], raw.headers.get(REPLICA_HEADER, "")


def test_two_replicas_answer_concurrent_requests_as_the_direct_server(ray_url: str, direct_url: str) -> None:
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        on_ray = list(pool.map(lambda r: ask(ray_url, *r), REQUESTS))
    direct = [ask(direct_url, *r)[0] for r in REQUESTS]
    assert [texts for texts, _ in on_ray] == direct
    assert all(texts and all(texts) for texts in direct)
    assert len({replica for _, replica in on_ray}) == 2  # both replicas answered


def test_loadtest_against_ray_checks_every_answer(ray_url: str) -> None:
    rows = loadtest.run(ray_url, ["def add(a, b):", "Hello, world!", "The quick brown fox"], [1, 3], max_tokens=12,
                        reference=True)
    assert [r["answers_differing"] for r in rows] == [0, 0, 0]
    assert all(r["tokens"] > 0 and r["tau_mean"] >= 1 for r in rows)


BAD = [  # (path, body or raw bytes)
    ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [10**9]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}),
    ("/v1/completions", {"prompt": "hi", "speculative": {"strategy": "nope"}}),
    ("/v1/completions", {"prompt": "hi", "speculative": {"strategy": "chain", "k": 0}}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/completions", b"{not json"),
    ("/v1/nothing", {}),
]


@pytest.mark.parametrize(("path", "body"), BAD)
def test_bad_input_gets_the_direct_servers_status_and_body(ray_url: str, direct_url: str, path: str, body) -> None:
    def post(url: str) -> httpx.Response:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
            {"json": body}
        return httpx.post(url + path, timeout=60, **kw)

    on_ray, direct = post(ray_url), post(direct_url)
    assert 400 <= direct.status_code < 500
    assert (on_ray.status_code, on_ray.json()) == (direct.status_code, direct.json())


def test_health_reports_the_replicas(ray_url: str) -> None:
    health = httpx.get(ray_url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["replicas"] == {"RUNNING": 2}
    assert health["replica"]["max_batch"] == 2 and health["replica"]["pid"] > 0
    assert httpx.get(ray_url + "/metrics", timeout=30).status_code == 404  # they go through Ray's metrics


def ray_metrics() -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every speculor sample on this node's Ray metrics port: {name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("ray_speculor_"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_go_through_ray_per_replica(ray_url: str) -> None:
    ask(ray_url, *REQUESTS[0])

    def exported() -> bool:
        m = ray_metrics()
        steps = {labels["replica"] for labels, v in m.get("ray_speculor_batch_size_count", []) if v > 0}
        requests = [labels for labels, v in m.get("ray_speculor_requests_total", []) if v > 0]
        return bool(steps) and any(r["deployment"] == "Ingress" and r["endpoint"] == "/v1/completions"
                                   for r in requests)

    wait_for(exported, "the replicas' and the ingress's metrics on Ray's metrics port", timeout=60)
    m = ray_metrics()
    assert {labels["deployment"] for labels, _ in m["ray_speculor_batch_size_count"]} == {"Replica"}
    for name in ("ray_speculor_tau_count", "ray_speculor_accepted_length_count", "ray_speculor_queue_depth",
                 "ray_speculor_request_latency_seconds_count", "ray_speculor_generated_tokens_total"):
        assert name in m, name


def test_client_disconnect_cancels_the_generation_on_its_replica(ray_url: str) -> None:
    def cancelled() -> float:
        return sum(v for labels, v in ray_metrics().get("ray_speculor_generations_total", [])
                   if labels["outcome"] == "cancelled")

    before = cancelled()
    body = {"prompt": "The quick brown fox", "max_tokens": 3500, "temperature": 0, "stream": True}
    with httpx.stream("POST", ray_url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text":' in line:
                break  # leave after the first chunk
    wait_for(lambda: cancelled() > before, "the replica to cancel the generation", timeout=60)


def replica_pids() -> dict[str, int]:
    """{replica id (as in the x-speculor-replica header): process id} of the running Replica actors, from Ray's
    actor table."""
    from ray._private import state

    prefix = "SERVE_REPLICA::speculor#Replica#"
    return {a["Name"].removeprefix(prefix): a["Pid"] for a in state.actors().values()
            if a["State"] == "ALIVE" and a["Name"].startswith(prefix)}


REPLICA_DIED = {"error": {"message": "the replica serving this request stopped mid-stream; ask again",
                          "type": "server_error", "param": None, "code": "replica_died"}}


class SSE(threading.Thread):
    """A completions stream read raw in a thread: its status and replica (`head` is set once they are known), its
    events' data in order, its text, and `first`: set at its first content chunk (or when it ends)."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.status, self.replica, self.events, self.text = 0, "", [], ""
        self.head, self.first = threading.Event(), threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as resp:
                self.status, self.replica = resp.status_code, resp.headers.get(REPLICA_HEADER, "")
                self.head.set()
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.events.append(data := line.removeprefix("data: "))
                    if data != "[DONE]" and (choices := json.loads(data).get("choices")):
                        self.text += choices[0]["text"]
                        if choices[0]["text"]:
                            self.first.set()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.failure = exc
        finally:
            self.head.set()
            self.first.set()


def test_a_replica_killed_mid_stream(ray_url: str, direct_url: str) -> None:
    """A replica killed (SIGKILL) while streams run on it and on the other replica: every stream on it ends with the
    OpenAI-style error event then [DONE] (never [DONE] before it, never a short answer without it), those on the
    other replica finish as the direct server answers; Ray brings the replica back and it serves again.

    Not timing-dependent: the streams are started one at a time until both replicas hold one (a replica takes
    max_batch + queue_size = 4 at once, so the fifth at the latest goes to the other), and the kill comes once the
    first stream on each replica has its first content chunk, each stream 3000 tokens long (seconds of generation)."""
    wait_for(lambda: replica_states() == {"RUNNING": 2} and len(replica_pids()) == 2, "two replicas", timeout=120)
    pids = replica_pids()
    streams: list[SSE] = []
    for prompt in ("def add(a, b):", "Hello, world!", "The quick", "Speculative", "lazy dog"):
        streams.append(sse := SSE(ray_url, {"prompt": prompt, "max_tokens": 3000, "temperature": 0}))
        sse.start()
        assert sse.head.wait(60) and sse.failure is None and sse.status == 200, (sse.status, sse.failure)
        if len({s.replica for s in streams}) == 2:
            break
    victim = streams[0].replica
    killed = [s for s in streams if s.replica == victim]
    others = [s for s in streams if s.replica != victim]
    assert others and set(pids) == {victim, others[0].replica}, (pids, [s.replica for s in streams])
    for s in (killed[0], others[0]):  # the first on each replica runs at once; later ones may wait in its queue
        assert s.first.wait(60) and s.failure is None, s.failure
    assert not any("[DONE]" in s.events for s in killed)  # all mid-stream: 3000 tokens take seconds
    os.kill(pids[victim], signal.SIGKILL)
    for s in streams:
        s.join(120)
        assert not s.is_alive() and s.failure is None, s.failure
    for s in killed:  # [content chunks...], the error event, [DONE]
        assert json.loads(s.events[-2]) == REPLICA_DIED and s.events[-1] == "[DONE]", s.events[-3:]
        assert all("choices" in json.loads(e) for e in s.events[:-2])  # no other error, no [DONE] before it
    for s in others:
        assert s.events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in s.events[:-1])
        assert s.text == ask(direct_url, False, False, {**s.body, "stream": False})[0][0]
    # Ray restarts the replica; it serves again
    wait_for(lambda: replica_states() == {"RUNNING": 2} and len(replica_pids()) == 2 and victim not in replica_pids(),
             "the replica to come back", timeout=120)
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        again = list(pool.map(lambda r: ask(ray_url, *r), REQUESTS))
    assert [texts for texts, _ in again] == [ask(direct_url, *r)[0] for r in REQUESTS]
    assert len({replica for _, replica in again}) == 2
    assert victim not in {replica for _, replica in again}  # the new replica among them


def test_refuses_replicas_no_node_can_hold(ray_url: str, folders) -> None:
    with pytest.raises(SpeculorError, match="no node of this Ray cluster can hold a replica"):
        check_fits(settings(folders, replica_memory_gib=10_000))
    check_fits(settings(folders))


def test_scale_down_drains_the_removed_replica(ray_url: str, direct_url: str, folders) -> None:
    """Redeployed with one replica while streams run on both: every stream finishes whole and right."""
    bodies = [{"prompt": p, "max_tokens": 1500, "temperature": 0} for p in ("Hello", "def", "The lazy", "fox")]
    with ThreadPoolExecutor(len(bodies)) as pool:
        running = [pool.submit(ask, ray_url, False, True, b) for b in bodies]
        time.sleep(1.0)
        serve.run(application(settings(folders, replicas=1)), name="speculor", route_prefix="/")
        answers = [f.result() for f in running]
    assert [a[0] for a in answers] == [ask(direct_url, False, False, b)[0] for b in bodies]
    wait_for(lambda: replica_states() == {"RUNNING": 1}, "one replica", timeout=60)


# ----------------------------------------------------------------------------------------- settings, no Ray needed

def test_settings_from_config_args() -> None:
    s = RaySettings.of({"target": "default", "replicas": "3", "max_batch": "4", "queue_size": "16", "threads": "2"})
    assert s.scaling() == {"num_replicas": 3} and s.actor_options()["num_cpus"] == 2.0 and s.backend == "auto"
    auto = RaySettings.of({"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 3})
    assert auto.scaling() == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                     "target_ongoing_requests": 3}}
    assert RaySettings.of({"device": "cuda"}).actor_options()["num_gpus"] == 1.0
    for bad, match in (({"replica": 2}, "replica: Extra inputs"), ({"replicas": 0}, "replicas"),
                       ({"min_replicas": 1}, "autoscaling needs max_replicas"),
                       ({"min_replicas": 3, "max_replicas": 2}, "must not exceed")):
        with pytest.raises(SpeculorError, match=match):
            RaySettings.of(bad)


def test_a_replica_loads_the_pair_speculor_serve_names() -> None:
    """The same options give the same PairSpec from `speculor serve`'s arguments and from Ray's settings."""
    from speculor import cli, commands
    from speculor.runtime.spec import PairSpec

    given = {"target": "t", "draft": "none", "kernels": "eager", "dtype": "bfloat16", "threads": 2, "calls": "batched",
             "backend": "llama.cpp"}
    argv = ["serve"] + [a for k, v in given.items() for a in (f"--{k}", str(v))]
    spec = RaySettings.of(given).pair_spec()
    assert spec == commands.pair_spec(cli._parser().parse_args(argv))
    assert spec.draft is None and not spec.packed and not spec.draft_int8 and str(spec.dtype) == "torch.bfloat16"
    assert RaySettings().pair_spec() == PairSpec()  # the defaults agree too (dtype auto on cpu: float32)


def test_memory_asked_is_the_pair_files_and_a_margin(folders) -> None:
    files = sum(f.stat().st_size for d in folders for f in d.glob("*.safetensors"))
    s = settings(folders)
    assert s.actor_options()["memory"] == int(round(files / 2**30 + 1.0, 2) * 2**30)
    assert RaySettings(target="/nowhere", draft="none").actor_options().get("memory") is None


def test_the_documented_serve_config_builds() -> None:
    import yaml

    from speculor.serving.ray_serve import build

    config = yaml.safe_load((Path(__file__).parents[1] / "docs" / "ray" / "speculor.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "speculor.serving.ray_serve:build"
    s = RaySettings.of(app["args"])
    assert s.backend == "auto" and s.scaling()["autoscaling_config"]["max_replicas"] == 4
    assert type(build(app["args"])).__name__ == "Application"


def test_coalesced_joins_what_is_ready_and_keeps_order_and_errors() -> None:
    import asyncio

    from speculor.serving.ray_serve import coalesced

    async def parts(fail: bool):
        for i in range(3):
            yield f"a{i}"  # ready at once: one message
        await asyncio.sleep(0.05)
        yield "b"
        if fail:
            raise ValueError("broken")

    async def read(fail: bool) -> list[str]:
        return [text async for text in coalesced(parts(fail))]

    assert asyncio.run(read(False)) == ["a0a1a2", "b"]
    with pytest.raises(ValueError, match="broken"):
        asyncio.run(read(True))


CHUNK = 'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'


async def replica_events(end: str | BaseException) -> AsyncIterator[str]:
    """A replica's stream as the ingress reads it: chunks (some joined, as `coalesced` sends them), then `end`:
    "done" ([DONE] joined to the last chunks), "stop" (it just ends), "after done" (an error once [DONE] went), or
    an exception."""
    yield CHUNK
    yield CHUNK + CHUNK
    if end == "done":
        yield CHUNK + "data: [DONE]\n\n"
    elif end == "after done":
        yield "data: [DONE]\n\n"
        raise ActorDiedError()
    elif isinstance(end, BaseException):
        raise end


def relayed(end: str | BaseException) -> list[str]:
    """The events' data the client gets from the ingress."""
    from speculor.serving.ray_serve import relay

    async def read() -> str:
        return "".join([text async for text in relay(replica_events(end))])

    return [e.removeprefix("data: ") for e in asyncio.run(read()).split("\n\n") if e]


@pytest.mark.parametrize("end", ["stop", ActorDiedError(), RayTaskError("generate", "", RuntimeError("boom")),
                                 ConnectionResetError("lost"), asyncio.CancelledError()],
                         ids=["ends", "actor died", "ray error", "connection lost", "ray cancelled"])
def test_relay_ends_a_replica_stream_without_done_with_the_error_event(end) -> None:
    """However a replica's events end without [DONE], the client gets the error event and then [DONE], never a
    short answer that looks whole."""
    chunk = CHUNK.removeprefix("data: ").strip()
    assert relayed(end) == [chunk] * 3 + [json.dumps(REPLICA_DIED), "[DONE]"]


def test_relay_passes_a_whole_stream_as_it_is() -> None:
    chunk = CHUNK.removeprefix("data: ").strip()
    assert relayed("done") == [chunk] * 4 + ["[DONE]"]
    assert relayed("after done") == [chunk] * 3 + ["[DONE]"]  # whole before the replica died: nothing to add


def test_relay_of_a_client_that_left_sends_nothing_more() -> None:
    """Closed (the client left) or cancelled (the request is), the relay ends at once without an error event, its
    replica's stream closed."""
    from speculor.serving.ray_serve import relay

    closed = []

    async def replica(wait: asyncio.Event | None = None) -> AsyncIterator[str]:
        try:
            while True:
                if wait is not None:
                    await wait.wait()
                yield CHUNK
        finally:
            closed.append(True)

    async def leave() -> None:
        events = relay(replica())
        assert await anext(events) == CHUNK
        await events.aclose()

    async def cancel() -> None:
        async def first() -> str:
            return await anext(relay(replica(asyncio.Event())))

        reader = asyncio.create_task(first())
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(leave())
    asyncio.run(cancel())
    assert closed == [True, True]


def test_the_openai_client_raises_the_relayed_error() -> None:
    """The relayed error event is what the openai client raises as openai.APIError (not a short answer)."""
    text = "".join(f"data: {e}\n\n" for e in relayed(ActorDiedError()))

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=text.encode())

    api = openai.OpenAI(base_url="http://ingress/v1", api_key="x", max_retries=0,
                        http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    got = ""
    with pytest.raises(openai.APIError, match="the replica serving this request stopped mid-stream"):
        for chunk in api.completions.create(model="x", prompt="hi", stream=True):
            got += chunk.choices[0].text
    assert got == "aaa"
