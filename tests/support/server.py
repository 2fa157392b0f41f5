"""The tiny random pair of the server and bench tests (Qwen2 architecture, built here, nothing downloaded) and a live
server for an app.

The pair's tokenizer is a byte-level BPE trained here on TEXTS, with chat special tokens and a chat template. The draft
is the target with slightly perturbed output weights: most draft tokens are accepted, some are not. The
end-of-sequence row of both output layers is zeroed so that greedy generations run to max_tokens.
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from speculor import Model, Pair

CONTEXT = 4096
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Hello, world! How are you today?", "Speculative decoding drafts tokens and verifies them."]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on TEXTS, with chat special tokens and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_pair() -> Pair:
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      eos_token_id=tokenizer.eos_token_id)
    target = Qwen2ForCausalLM(cfg)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.005 * torch.randn_like(draft.lm_head.weight))
        for model in (target, draft):
            model.lm_head.weight[tokenizer.eos_token_id] = 0
    return Pair(Model(target), Model(draft), tokenizer, "tiny-target", "tiny-draft")


def save_tiny_pair(folder: Path) -> tuple[Path, Path]:
    """tiny_pair's target and draft saved as transformers folders (with the tokenizer): what a process that loads
    models by path (a Ray Serve replica, `speculor serve`) loads; returns (target folder, draft folder)."""
    pair = tiny_pair()
    dirs = folder / "tiny-target", folder / "tiny-draft"
    for lm, d in zip((pair.target, pair.draft), dirs, strict=True):
        lm.model.save_pretrained(d)
        pair.tokenizer.save_pretrained(d)
    return dirs


@contextmanager
def live_server(app) -> Iterator[str]:
    """Run `app` with uvicorn on a free port of 127.0.0.1 in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextmanager
def hold_target(pair: Pair) -> Iterator[None]:
    """While held, every target forward on `pair` waits: the server's running job blocks, later ones queue."""
    gate = threading.Event()
    forward = pair.target.forward

    def gated(*args, **kwargs):
        gate.wait(60)
        return forward(*args, **kwargs)

    pair.target.forward = gated
    try:
        yield
    finally:
        del pair.target.forward
        gate.set()


def wait_for(cond, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def queued(http: httpx.Client) -> tuple[bool, int]:
    """(a generation is running, requests waiting)."""
    health = http.get("/health").json()
    return health["running"], health["queue_depth"]


def prebuild(app, specs) -> None:
    """Build the strategies the requests will name (each `speculative` body, None: the server's), as a server that
    has served them before has: a request naming a new one waits for the step in progress to build it
    (serving/scheduler.py `build`), so it could not queue behind a held target."""
    srv = app.state.server
    for spec in specs:
        if spec is not None:
            options = {k: v for k, v in spec.items() if k != "strategy"}
            name, merged = srv.sp.options_for(spec.get("strategy"), options)
            srv.sp.strategy_for(name, **merged)


def post_together(pair: Pair, http: httpx.Client, post, n: int, timeout: float = 120) -> None:
    """Run post(i) for i < n in threads whose requests end up in one batch: while the target is held the first waits
    in its prefill and the others queue in order; then they join the batch one by one. The strategies they name must
    be built already (`prebuild`)."""
    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    with hold_target(pair):
        for i, t in enumerate(threads):
            t.start()
            wait_for(lambda i=i: queued(http) == (1, i), f"request {i} to queue")
    for t in threads:
        t.join(timeout)
