"""The gateway and multi-LoRA engines: it learns each engine's models from its
/v1/models, sends an adapter's requests only to the engines that hold it (prefix-aware
within them), lists the union of the engines' models, and labels its request metrics
with base model and adapter.

The routing tests run a real gateway process in front of stand-in engine processes
(tests/fake_lora_engine.py) that answer with their own name, so every answer says
which engine served it; the last test puts two real engines with different adapters
behind the gateway.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from llmserve.entrypoints.launcher import ServerProcess, scrape_metrics
from llmserve.gateway.endpoints import EndpointPool
from llmserve.gateway.models import labels_for, merge_model_lists, parse_model_list
from llmserve.gateway.prefix import prefix_key
from llmserve.gateway.routing import HashRing, PrefixHashPolicy
from llmserve.utils import free_port
from tests.lora_adapters import write_peft_adapter
from tests.server_proc import ServerProcess as EngineProcess

FAKE_ENGINE = Path(__file__).parents[1] / "fake_lora_engine.py"
BASE = "tiny"


class FakeEngine(ServerProcess):
    """tests/fake_lora_engine.py as a process on ``host``, ready once /health is 200."""

    def __init__(self, name: str, host: str, adapters: dict[str, str]):
        self.name, self.host, self.port = name, host, free_port(host)
        cmd = [sys.executable, str(FAKE_ENGINE), "--host", host, "--port", str(self.port),
               "--name", name, "--base", BASE]
        for adapter, path in adapters.items():
            cmd += ["--adapter", f"{adapter}={path}"]
        self.proc = subprocess.Popen(cmd)
        self.wait_ready(60)


def start_gateway(urls, host: str) -> ServerProcess:
    args = ["gateway", "--scrape-interval", "0.3", "--log-level", "WARNING"]
    for url in urls:
        args += ["--backend", url]
    return ServerProcess(args, host)


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def complete(url: str, model: str, prompt: str) -> tuple[int, str]:
    """(status, the answering engine's name or the error code) of a completion."""
    status, text = post(url + "/v1/completions", {"model": model, "prompt": prompt,
                                                   "max_tokens": 1})
    body = json.loads(text)
    return status, body["choices"][0]["text"] if status == 200 else body["error"]["code"]


def wait_until(check, what: str, timeout: float = 60.0):
    """Poll ``check`` until it returns something true (a liveness bound, not a timing
    assertion: the gateway learns on its next probes, every 0.3 s here)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def series_sum(url: str, name: str, **labels) -> float:
    """``name`` summed over the label sets that include ``labels``."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    return sum(value for key, value in scrape_metrics(url).items()
               if key.startswith(name + "{") and want <= set(key[len(name) + 1:-1].split(",")))


# --- pure parts: keys, the pool's choice of candidates, model lists ------------------------
def entries(*adapters: str) -> dict[str, dict]:
    """A catalogue as an engine serving BASE with ``adapters`` lists it."""
    data = [{"id": BASE, "object": "model"}]
    data += [{"id": a, "object": "model", "root": f"/x/{a}", "parent": BASE} for a in adapters]
    return parse_model_list({"object": "list", "data": data})


def test_adapters_with_the_same_prompt_route_by_different_keys():
    urls = [f"http://127.0.0.{i}:8000" for i in range(1, 5)]
    ring = HashRing(urls)
    owners_differ = 0
    for i in range(40):
        prompt = f"the shared system prompt {i}"
        key_a = prefix_key({"model": "a", "prompt": prompt})
        key_b = prefix_key({"model": "b", "prompt": prompt})
        assert key_a != key_b and key_a == prefix_key({"model": "a", "prompt": prompt})
        chat = [{"role": "user", "content": prompt}]
        assert prefix_key({"model": "a", "messages": chat}) != \
            prefix_key({"model": "b", "messages": chat})
        owners_differ += ring.owner(key_a) != ring.owner(key_b)
    # Same prompt, different adapter: the owners are independent (each adapter's KV
    # prefixes are its own; sharing an owner would only pile them onto one engine).
    assert owners_differ > 0


def pool_of(catalogues: dict[str, dict | None]) -> EndpointPool:
    pool = EndpointPool(max_waiting=4)
    pool.set_urls(catalogues)
    for url, models in catalogues.items():
        pool.endpoints[url].models = models
    return pool


def test_an_adapter_is_routed_among_its_holders_with_the_usual_spill_over():
    e1, e2, e3, e4 = (f"http://127.0.0.{i}:8000" for i in range(1, 5))
    pool = pool_of({e1: entries("a", "s"), e2: entries("b", "s"), e3: entries(), e4: None})
    urls = lambda model, **kw: sorted(c.url for c in pool.candidates(model=model, **kw))  # noqa: E731
    assert urls("a") == [e1] and urls("b") == [e2] and urls("s") == [e1, e2]
    # The base model, a name nobody lists, and no model: every live endpoint, the one
    # not probed yet included.
    assert urls(BASE) == urls("nope") == urls(None) == [e1, e2, e3, e4]
    # Spill-over within the holders: a saturated holder is passed over for the other.
    policy = PrefixHashPolicy()
    pool.endpoints[e1].waiting = 100
    chosen = {policy.choose(pool.candidates(model="s"), f"k{i}").url for i in range(50)}
    assert chosen == {e2}
    # All holders saturated: still a holder (the others cannot serve it).
    pool.endpoints[e2].waiting = 100
    chosen = {policy.choose(pool.candidates(model="s"), f"k{i}").url for i in range(50)}
    assert chosen <= {e1, e2} and len(chosen) == 2
    # No live holder (ejected, or tried already): the normal choice among the rest,
    # since one of them may have loaded it since its last probe.
    pool.endpoints[e1].ejected_until = time.monotonic() + 60
    assert urls("a") == [e2, e3, e4]
    assert urls("b", exclude={e2}) == [e3, e4]


def test_an_endpoint_that_goes_takes_its_models_with_it():
    url = "http://127.0.0.1:8000"
    pool = pool_of({url: entries("a")})
    pool.set_urls([])
    pool.set_urls([url])
    assert pool.endpoints[url].models is None
    assert labels_for("a", pool.catalogues()) == ("unknown", "")


def test_model_lists_merge_and_label():
    one, two = entries("a", "s"), entries("s", "b")
    merged = merge_model_lists([one, None, two])
    assert [m["id"] for m in merged] == [BASE, "a", "s", "b"]
    assert all(m["parent"] == BASE for m in merged[1:]) and "parent" not in merged[0]
    assert labels_for("a", [None, one]) == (BASE, "a")
    assert labels_for(BASE, [one, two]) == (BASE, "")
    # A client's made-up name never becomes a label value (unbounded series).
    assert labels_for("made-up", [one, two]) == ("unknown", "")
    assert labels_for(None, [one]) == labels_for(7, [one]) == ("", "")
    for bad in ({"data": "x"}, [], {"object": "list"}):
        with pytest.raises(ValueError):
            parse_model_list(bad)
    assert parse_model_list({"data": [{"id": 3}, "x", {"id": "ok"}]}) == {"ok": {"id": "ok"}}


# --- a real gateway in front of stand-in engines ------------------------------------------
@pytest.fixture(scope="module")
def fleet():
    procs = []
    try:
        engines = {name: FakeEngine(name, f"127.0.0.{31 + i}", adapters) for i, (name, adapters)
                   in enumerate([("E1", {"a": "/adapters/a", "s": "/adapters/s"}),
                                 ("E2", {"b": "/adapters/b", "s": "/adapters/s"}),
                                 ("E3", {})])}
        procs += engines.values()
        gateway = start_gateway([e.url for e in engines.values()], "127.0.0.30")
        procs.append(gateway)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        # The gateway has probed the engines once its request metrics know a and b.
        wait_until(lambda: all(complete(gateway.url, a, "probe") and labelled(gateway, a)
                               for a in ("a", "b")),
                   "the gateway to learn the engines' adapters")
        yield gateway, engines, client
    finally:
        for p in procs:
            p.stop()


def served_by(client: openai.OpenAI, model: str, prompt: str, chat: bool = False) -> str:
    """The name of the engine that answered."""
    if chat:
        r = client.chat.completions.create(model=model, max_tokens=1,
                                           messages=[{"role": "user", "content": prompt}])
        return r.choices[0].message.content
    return client.completions.create(model=model, prompt=prompt, max_tokens=1).choices[0].text


def labelled(gateway, adapter: str) -> bool:
    return series_sum(gateway.url, "llmserve_gateway_requests_total", adapter=adapter) > 0


def test_the_gateway_lists_every_engines_models_once(fleet):
    gateway, engines, client = fleet
    models = client.models.list().data
    assert [m.id for m in models] == [BASE, "a", "s", "b"]
    by_id = {m.id: m.model_dump() for m in models}
    assert all(by_id[a]["parent"] == BASE and by_id[a]["root"] == f"/adapters/{a}"
               for a in ("a", "s", "b"))
    assert by_id[BASE].get("parent") is None and by_id[BASE]["max_model_len"] == 2048


def test_adapter_requests_reach_only_the_engines_holding_them(fleet):
    gateway, engines, client = fleet
    prompts = [f"prompt {i}: a long enough shared prefix for the routing key" for i in range(30)]
    for i, p in enumerate(prompts):
        chat = i % 2 == 1
        assert served_by(client, "a", p, chat) == "E1"
        assert served_by(client, "b", p, chat) == "E2"
    # Held by two: prefix hashing spreads its keys over both holders, never elsewhere.
    assert {served_by(client, "s", p) for p in prompts} == {"E1", "E2"}
    # The base model: every engine serves it.
    assert len({served_by(client, BASE, p) for p in prompts}) >= 2
    # A key sticks to its engine: the same prompt again meets the same engine.
    assert all(served_by(client, "s", p) == served_by(client, "s", p) for p in prompts[:5])


def test_request_metrics_carry_the_base_model_and_adapter(fleet):
    gateway, engines, client = fleet
    name = "llmserve_gateway_requests_total"
    want = {"a": {"model": BASE, "adapter": "a", "code": "200", "path": "/v1/completions"},
            "base": {"model": BASE, "adapter": ""},
            "unknown": {"model": "unknown", "adapter": "", "code": "404"}}
    before = {k: series_sum(gateway.url, name, **labels) for k, labels in want.items()}
    for i in range(3):
        served_by(client, "a", f"metrics {i}")
    served_by(client, BASE, "metrics base")
    with pytest.raises(openai.NotFoundError):
        served_by(client, "made-up-model", "metrics unknown")
    gained = {k: series_sum(gateway.url, name, **labels) - before[k]
              for k, labels in want.items()}
    assert gained == {"a": 3, "base": 1, "unknown": 1}
    exported = urllib.request.urlopen(gateway.url + "/metrics", timeout=10).read().decode()
    assert "made-up-model" not in exported  # a client's name is never a label value
    assert 'llmserve_gateway_upstream_latency_seconds_count{adapter="a",model="tiny"}' \
        in exported


def test_an_adapter_nobody_holds_falls_back_and_a_newly_loaded_one_is_learned(fleet):
    gateway, engines, client = fleet
    e1, e3 = engines["E1"], engines["E3"]
    # Nobody lists "c": the normal choice among all engines, and an engine without it
    # answers its own 404 model_not_found (OpenAI's shape, through the gateway as is).
    status, text = post(gateway.url + "/v1/completions",
                        {"model": "c", "prompt": "fallback", "max_tokens": 1})
    error = json.loads(text)["error"]
    assert status == 404 and error["code"] == "model_not_found"
    assert set(error) == {"message", "type", "param", "code"}
    # A prompt whose key the ring gives to an engine other than E3: it is answered
    # 404 by that engine while nobody holds "c" ...
    other = next(p for p in (f"fallback {i}" for i in range(100))
                 if complete(gateway.url, "c", p) == (404, "model_not_found"))
    # ... and by E3 once E3 has loaded "c" and the gateway's probes have seen it.
    assert post(e3.url + "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/c"})[0] \
        == 200
    # Learned: ten prompts in a row reach E3 (the fallback's ring or its bounded-load
    # walk could send one there by chance, never ten).
    wait_until(lambda: all(complete(gateway.url, "c", p) == (200, "E3")
                           for p in (other, *(f"learn {i}" for i in range(10)))),
               "the gateway to learn that E3 holds c")
    assert {served_by(client, "c", f"fallback {i}") for i in range(30)} == {"E3"}
    # Moved to E1: the gateway forgets E3's copy and routes to E1's.
    assert post(e3.url + "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200
    assert post(e1.url + "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/c"})[0] \
        == 200
    wait_until(lambda: all(complete(gateway.url, "c", f"moved {i}") == (200, "E1")
                           for i in range(10)),
               "the gateway to learn that c moved to E1")
    assert {served_by(client, "c", f"moved {i}") for i in range(30)} == {"E1"}
    assert post(e1.url + "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200


# --- real engines with different adapters behind the gateway ------------------------------
@pytest.fixture(scope="module")
def lora_fleet(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway-adapters")
    adapters = {name: write_peft_adapter(tiny_llama, root / name, rank=8, seed=seed)
                for seed, name in enumerate(("a", "b"), start=1)}
    procs = []
    try:
        engines = [EngineProcess(str(tiny_llama), host=f"127.0.0.{36 + i}", extra=[
            "--served-model-name", BASE, "--enable-lora", "--lora-modules",
            f"{name}={adapters[name]}"]) for i, name in enumerate(("a", "b"))]
        procs += engines
        gateway = start_gateway([e.url for e in engines], "127.0.0.35")
        procs.append(gateway)
        yield gateway, dict(zip(("a", "b"), engines)), adapters
    finally:
        for p in procs:
            p.stop()


def successes(engine) -> float:
    return scrape_metrics(engine.url).get("vllm:request_success_total", 0.0)


def test_real_engines_serve_their_own_adapters_through_the_gateway(lora_fleet):
    gateway, engines, adapters = lora_fleet
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    listed = client.models.list().data
    assert [m.id for m in listed] == [BASE, "a", "b"]
    assert {m.id: (m.parent, m.root) for m in listed[1:]} == {
        name: (BASE, str(path)) for name, path in adapters.items()}
    # Wait for the probes (the listing above read the engines itself): a request the
    # gateway knows to be for adapter "a" is labelled so.
    wait_until(lambda: client.completions.create(model="a", prompt="probe", max_tokens=1)
               and series_sum(gateway.url, "llmserve_gateway_requests_total", adapter="a"),
               "the gateway to learn the engines' adapters")
    prompts = [f"request {i} to an adapter" for i in range(8)]
    for name, holder in engines.items():
        other = engines["b" if name == "a" else "a"]
        before = successes(holder), successes(other)
        for p in prompts:
            via = client.completions.create(model=name, prompt=p, max_tokens=4, temperature=0)
            direct = openai.OpenAI(base_url=holder.url + "/v1", api_key="x").completions.create(
                model=name, prompt=p, max_tokens=4, temperature=0)
            assert via.model == name and via.choices[0].text == direct.choices[0].text
        # Every request for the adapter ran on its holder (each twice: via and direct),
        # none on the engine without it (which would have answered 404).
        assert (successes(holder) - before[0], successes(other) - before[1]) == \
            (2 * len(prompts), 0)
    assert series_sum(gateway.url, "llmserve_gateway_requests_total", model=BASE,
                      adapter="b", code="200") == len(prompts)
