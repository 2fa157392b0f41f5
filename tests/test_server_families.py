"""The architecture matrix through the server: for every family (support/families.py), two requests that overlap in
one batch (one greedy with chain drafting, one sampled with a seed and a tree) each get the answer the library gives
it alone."""

from __future__ import annotations

import httpx
import pytest
from support.families import FAMILIES, family_model
from support.server import TEXTS, live_server, post_together, prebuild, tiny_tokenizer
from support.tiny import perturbed

from speculor import Model, Pair, SamplingConfig, Speculor
from speculor.serving.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

REQUESTS = [({"temperature": 0}, {"strategy": "chain", "k": 3}),
            ({"temperature": 0.9, "seed": 5}, {"strategy": "specinfer", "expansion": "2-1-1"})]


@pytest.mark.parametrize("name", FAMILIES)
def test_two_overlapping_requests_each_get_their_answer_alone(name):
    tokenizer = tiny_tokenizer()
    target = family_model(name, vocab=len(tokenizer), context=512)
    pair = Pair(Model(target), Model(perturbed(target, 0.1, seed=1)), tokenizer, name, "near")
    answers: dict[int, dict] = {}
    app = create_app(pair, strategy="chain", max_batch=2)
    prebuild(app, [spec for _, spec in REQUESTS])
    with live_server(app) as base, httpx.Client(base_url=base, timeout=120) as http:

        def post(i: int) -> None:
            sampling, spec = REQUESTS[i]
            body = {"prompt": TEXTS[i], "max_tokens": 20, "speculative": spec, **sampling}
            answers[i] = http.post("/v1/completions", json=body).json()

        post_together(pair, http, post, 2)
    sp = Speculor(pair)
    for i, (sampling, spec) in enumerate(REQUESTS):
        options = {k: v for k, v in spec.items() if k != "strategy"}
        alone = sp.generate(sp.encode(TEXTS[i]), SamplingConfig(max_new_tokens=20, **sampling),
                            strategy=spec["strategy"], **options)
        assert answers[i]["choices"][0]["text"] == alone.text, (name, i)
        assert answers[i]["usage"]["completion_tokens"] == len(alone.token_ids)
