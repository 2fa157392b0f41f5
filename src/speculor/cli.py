"""Command line: `speculor generate | bench | calibrate | profile | train-head | tune-threshold | refit-priors |
fetch-models | serve | loadtest | toolbench`.
argparse lives here only; what the commands do is in the commands package (one module per command)."""

from __future__ import annotations

import argparse
import sys

from speculor.bench.peer_server import CONFIGS, parse_peers
from speculor.commands import (
    STRATEGIES,
    TAKEN_BY,
    bench,
    boost_tune,
    calibrate,
    fetch_models,
    generate,
    llama_flags,
    loadtest,
    profile,
    refit_priors,
    serve,
    toolbench,
    train_head,
    tune_threshold,
)
from speculor.errors import SpeculorError

SETS_HELP = ("prompt sets, comma-separated: mtbench, humaneval, sharegpt, code-edit, summarize, repeat-edit, "
             "file-edit, or a JSONL file of your own prompts (MT-Bench's and Spec-Bench's question.jsonl, or one "
             "{\"prompt\": ...} a line)")


def _add_model_args(p: argparse.ArgumentParser, backend: str = "auto", llama: bool = False) -> None:
    """The pair's options; backend: --backend's default (torch for the commands that need transformers' models);
    llama: also under llama-server's spellings (`speculor serve`)."""
    spell = (lambda *names: names) if llama else (lambda *names: ())  # noqa: E731
    p.add_argument("--target", *spell("-m", "--model"), default="default",
                   help="target model: 'default', a folder, a .gguf file")
    p.add_argument("--draft", *spell("-md", "--model-draft", "--spec-draft-model"), default="default",
                   help="draft model: 'default', a folder, a .gguf file, 'none'")
    why = ("; this command trains or tunes on the draft's transformers model" if backend == "torch" else
           "; measured once per machine and cached, nothing measured where only torch can run the pair (--device "
           "cuda, a model that is not GGUF)")
    p.add_argument("--backend", choices=("auto", "torch", "llama.cpp"), default=backend,
                   help=f"what runs the forwards (default: {backend}{why}): auto (the one this machine's measured "
                   "cost curves predict fastest; it says on stderr what it chose), torch (transformers; the fp32 "
                   "reference, and the GPU), llama.cpp (the GGUF files on llama.cpp's own quantized kernels). Output "
                   "is exact against the chosen backend's own plain decoding")
    p.add_argument("--threads", *spell("-t"), type=int, default=None,
                   help="CPU threads of either backend (default: torch's)")
    p.add_argument("--calls", choices=("exact", "vector", "batched"), default="exact",
                   help="llama.cpp's calls: exact (default; every row gets the bits of a one-row call in calls of "
                   "up to 31 rows shared with any requests, so speculative output is plain decoding's and no answer "
                   "depends on what shares its batch; needs llama.cpp built with patches/llama.cpp, checked at load, "
                   "else vector), vector (the same guarantees from calls of at most 3 rows, on llama.cpp as released) "
                   "or batched (llama.cpp's own call sizes: more throughput under load on llama.cpp as released, "
                   "neither guarantee)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="the models' weights and arithmetic (auto: bfloat16 on cuda, float32 on cpu); greedy output "
                   "equals the target's own only where both run in the same dtype, float32 for a bitwise check")
    p.add_argument("--offload", action="store_true",
                   help="keep the target's weights in (pinned) CPU memory and stream them to --device for each "
                   "forward (accelerate's cpu_offload); the draft stays on the device. A forward then costs about the "
                   "same for 1 or hundreds of rows: large trees pay most")
    p.add_argument("--kernels", choices=("fast", "eager"), default="fast",
                   help="fast: the target's matmuls through oneDNN weights prepacked once, the draft with int8 weights "
                   "and a lean forward, each fp32 weight released (CPU, fp32; ~7 GiB for the embedded pair); eager: "
                   "plain nn.Linear for both (what the models do by themselves)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="FR-Spec: the draft proposes only the N most frequent tokens (a shipped list, special "
                   "tokens always in; e.g. 32768); its head then computes N logits, not the whole vocabulary. "
                   "Output unchanged. Default: the full vocabulary")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)


def _budget(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _add_strategy_args(p: argparse.ArgumentParser) -> None:
    """--strategy and the strategy options; an option is passed on only when given, and only a strategy that
    takes it accepts it (`_strategy_options`)."""
    g = p.add_argument_group("strategy options", "Each option is taken only by the strategies named in its help; "
                             "giving one that the chosen strategy does not take is an error. Not given: the "
                             "strategy's own default.")
    g.add_argument("--strategy", default="default", help=f"one of {', '.join(STRATEGIES)} (default: default, "
                   "suffix drafts with --budget auto and dyspec's as their fallback where a draft model is loaded, "
                   "sized for the running batch; its options are suffix's)")

    def opt(flag: str, what: str, **kw) -> None:
        taken = ", ".join(TAKEN_BY[flag.lstrip("-").replace("-", "_")])
        g.add_argument(flag, default=None, help=f"(taken by {taken}) {what}", **kw)

    opt("--k", "chain: draft length; ngram: tokens per continuation; topk-tree: children per node and nodes "
        "expanded per step; gsd: context tokens that must repeat for a merge", type=int)
    opt("--budget", "draft tokens per step, or 'auto' (sequoia, dyspec) to size the tree by this machine's "
        "cost profile", type=_budget)
    opt("--depth", "most draft tokens on a path", type=int)
    opt("--width", "most children per node", type=int)
    opt("--acc", "calibration JSON (default: cached, else built-in)")
    opt("--threshold", "specdecpp: stop when 1 - prod P̂ > h (default: tuned); dyspec: smallest draw value drawn "
        "(default: steered)", type=float)
    opt("--head", "head file (default: the packaged head)")
    opt("--heads", "a pool folder made by `speculor boost-tune` (default: the shipped pool, for the embedded target)")
    opt("--k-min", "fewest draft tokens per step (default 2)", type=int)
    opt("--k-max", "most draft tokens per step (default 20)", type=int)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `speculor bench` (`speculor.bench.run.run` reads them). The defaults shown are those of
    bench/config.py's DEFAULTS and QUICK tables (options left None here take them in `BenchConfig.from_args`)."""
    p.add_argument("--strategies", default=None, help="comma-separated; options after colons, e.g. "
                   "plain,chain:k=2,chain:k=6,hf-assisted (default plain,default,chain:k=4,dyspec:budget=auto); "
                   "llama-server's rows name its configuration after the colon: llama-server (its plain decoding), "
                   f"llama-server:CONFIG with CONFIG one of {', '.join(CONFIGS)}, or llama-server:all")
    p.add_argument("--sets", default="mtbench,humaneval", help=SETS_HELP)
    p.add_argument("--limit", type=int, default=None, help="number of prompts, spread over sets and categories "
                   "(default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="(default 128)")
    p.add_argument("--temperatures", default=None, help="comma-separated, e.g. 0,0.7 (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=None, help="rounds: every (prompt, strategy) once per round, the "
                   "strategies' order shuffled; the median over rounds and the min-max spread are kept (default 3)")
    p.add_argument("--format", choices=("speculor", "spec-bench"), default="speculor", help="spec-bench: also "
                   "write Spec-Bench's answer files (out/spec-bench/model_answer_temp{T}_run_{k}/{strategy}.jsonl)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="folder for records.jsonl, summary.json, table.md and plots")
    p.add_argument("--batch", default=None, help="comma-separated batch sizes, e.g. 1,4,16: every strategy with that "
                   "many prompts decoded together (entries 'L@B'; plain@1 is always run as the reference)")
    p.add_argument("--quick", action="store_true", help="the README's main job: every strategy and the peers that "
                   "run beside the loaded pair (llama.cpp's own plain decoding where the target is a GGUF file, "
                   "llama-server plain, ngram-mod and draft where its binary is built too, the two transformers peers "
                   "on torch), 2 prompts, 32 tokens, one round (a smoke run: its ratios are indicative only); flags "
                   "given explicitly still apply")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="the llama-server rows' binary (default: "
                   "the one `make llama-server` built, else llama-server on PATH)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speculor", description="Lossless speculative decoding with token trees.")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    b = sub.add_parser("bench", help="benchmark strategies against plain decoding on real prompts")
    add_bench_arguments(b)
    _add_model_args(b)
    _add_calibrate_parser(sub)
    _add_profile_parser(sub)
    _add_train_head_parser(sub)
    _add_boost_tune_parser(sub)
    _add_tune_threshold_parser(sub)
    _add_refit_priors_parser(sub)
    sub.add_parser("fetch-models", help="download and convert the embedded model pair and prompt sets")
    _add_serve_parser(sub)
    _add_loadtest_parser(sub)
    _add_toolbench_parser(sub)
    return ap


def _add_generate_parser(sub) -> None:
    """`speculor generate`."""
    g = sub.add_parser("generate", help="generate text for one prompt, streaming it")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the most likely one's "
                   "probability (0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], as in the OpenAI API")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], as in the OpenAI API")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 = off (as in transformers)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and its N most likely alternatives")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output matches this JSON schema (exactly: every "
                       "verified token is masked by it)")
    shape.add_argument("--grammar", metavar="FILE", help="the output matches this GBNF grammar (llama.cpp's), or a "
                       "Lark grammar (llguidance's) when FILE ends in .lark")
    _add_strategy_args(g)
    _add_model_args(g)
    _add_sampling_args(g)


def _add_calibrate_parser(sub) -> None:
    """`speculor calibrate`."""
    c = sub.add_parser("calibrate", help="measure Sequoia's acceptance vector for a model pair (cached)")
    c.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 = greedy matching of top-W")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--width", type=int, default=16, help="children drafted per step (W)")
    c.add_argument("--prompts", type=int, default=12, help="number of prompts")
    c.add_argument("--steps", type=int, default=24, help="steps per prompt")
    c.add_argument("--sets", default="mtbench,humaneval")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default=None, help="JSON file (default: the cache, where `sequoia` looks)")
    _add_model_args(c)


def _add_profile_parser(sub) -> None:
    """`speculor profile`."""
    pr = sub.add_parser("profile", help="time target and draft forwards on this machine; show the auto tree")
    pr.add_argument("--repeats", type=int, default=3)
    pr.add_argument("--force", action="store_true", help="profile again even if a profile is cached")
    pr.add_argument("--temperatures", default="0,0.7", help="show the chosen tree at these temperatures")
    pr.add_argument("--depth", type=int, default=8)
    pr.add_argument("--width", type=int, default=8)
    _add_model_args(pr)


def _add_serve_parser(sub) -> None:
    """`speculor serve`."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (a drop-in for llama-server)",
                       description="OpenAI-compatible HTTP server, also answering llama-server's /completion, "
                       "/tokenize, /detokenize and /props. llama-server's spellings of the same settings are taken as "
                       "aliases (-m, -md, -c, -np, -t, -tb, -n, -a, --jinja, --api-key, --api-key-file, "
                       "--ssl-key-file, --ssl-cert-file, -to); any other llama-server flag is an error naming it.")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1); any other than "
                   "the loopback without an API key is warned about")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--queue-size", type=int, default=64)
    s.add_argument("--max-batch", "-np", "--parallel", type=int, default=16,
                   help="most requests decoded together (continuous batching; llama-server's slots)")
    s.add_argument("--context", "-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="the most tokens a request's prompt and answer hold (llama.cpp: also the cells of the KV "
                   "memory all requests share; default: the backend's, 16384 on llama.cpp)")
    s.add_argument("--n-predict", "-n", "--predict", type=int, default=None, metavar="N",
                   help="new tokens of a request that gives no max_tokens / n_predict (default, or -1: each route's "
                   "own: 16 for /v1/completions, the rest of the context elsewhere)")
    s.add_argument("--alias", "-a", default=None, help="the model name the server reports (default: the target's)")
    s.add_argument("--threads-batch", "-tb", type=int, default=None, metavar="N",
                   help="llama-server's prompt threads: taken only equal to --threads (one thread count here)")
    s.add_argument("--jinja", action="store_true", help="taken, as llama-server's: the model's chat template always "
                   "applies (Jinja)")
    _add_network_args(s)
    _add_strategy_args(s)
    _add_model_args(s, llama=True)
    _add_ray_args(s)


def _add_network_args(s: argparse.ArgumentParser) -> None:
    """`speculor serve`'s network safety (serving/security.py); llama-server's spellings where it has them."""
    n = s.add_argument_group("network safety", "API keys, TLS and the limits on slow or large requests")
    n.add_argument("--api-key", action="append", default=None, metavar="KEY", help="every route but /health then "
                   "needs 'Authorization: Bearer KEY' (comma-separated keys, or repeated; never logged)")
    n.add_argument("--api-key-file", default=None, metavar="FILE", help="API keys, one a line (# comments)")
    n.add_argument("--ssl-key-file", "--ssl-keyfile", dest="ssl_keyfile", default=None, metavar="FILE",
                   help="TLS: the PEM private key (with --ssl-cert-file)")
    n.add_argument("--ssl-cert-file", "--ssl-certfile", dest="ssl_certfile", default=None, metavar="FILE",
                   help="TLS: the PEM certificate")
    n.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="a request body over N bytes is refused, 413 (default: 4 MiB)")
    n.add_argument("--timeout", "-to", type=float, default=None, metavar="S",
                   help="seconds a request body may take to arrive (else 408) and a write may wait for the client to "
                   "read (else it is cut off and its generation cancelled) (default: 60)")
    n.add_argument("--timeout-keep-alive", type=float, default=None, metavar="S",
                   help="an idle kept-alive connection is closed after S seconds (default: uvicorn's, 5)")


def _add_loadtest_parser(sub) -> None:
    """`speculor loadtest`."""
    lt = sub.add_parser("loadtest", help="latency and throughput of a running server at several concurrencies")
    lt.add_argument("--url", default="http://127.0.0.1:8000")
    lt.add_argument("--clients", default="1,4,16,32", help="comma-separated concurrencies, one round each")
    lt.add_argument("--requests", type=int, default=1, help="requests per client in a round, one after another")
    lt.add_argument("--sets", default="mtbench,humaneval", help=SETS_HELP)
    lt.add_argument("--limit", type=int, default=16, help="prompts taken from the sets (mixed in turn)")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--strategy", default=None, help="the requests' speculative strategy, or several comma-separated "
                    "(one series each; `default`: the server's own, the default)")
    lt.add_argument("--reference", action="store_true", help="first ask every prompt alone, one after another: "
                    "every later answer is checked against its one-client answer")
    lt.add_argument("--out", default=None, help="JSON file for the rows (and a PNG plot beside it)")
    lt.add_argument("--peer", type=_peer_configs, default=None, metavar="llama-server[:CONFIG],...",
                    help="after our rounds, start llama-server as its users do (-m GGUF -t/-tb --threads -c 32768 "
                    "-np the largest --clients --jinja) in each configuration named, one after another, and run the "
                    "same rounds against it (implies --reference): llama-server (its plain decoding), "
                    f"llama-server:CONFIG with CONFIG one of {', '.join(CONFIGS)}, or llama-server:all. The table "
                    "gets every row's tokens/s ÷ llama-server's best configuration at the same client count (and ÷ "
                    "its plain decoding where that ran). Its binary: `make llama-server`")
    lt.add_argument("--llama-server", default=None, metavar="PATH", help="the peer's binary (default: the one "
                    "`make llama-server` built, else llama-server on PATH)")
    lt.add_argument("--gguf", default="default", help="the peer's model: 'default' (the embedded target's GGUF), "
                    "an embedded model's name or a .gguf file; give the target our server runs")
    lt.add_argument("--threads", type=int, default=None, help="the peer's -t and -tb (give our server's --threads; "
                    "default: this machine's CPU count)")
    lt.add_argument("--draft-gguf", default="default", help="the draft model of llama-server:draft: 'default' "
                    "(the embedded draft's GGUF), an embedded model's name or a .gguf file")


def _peer_configs(text: str) -> list[str]:
    """--peer's configurations (bench/peer_server.py `parse_peers`); argparse's own error (exit 2) for a bad one."""
    try:
        return parse_peers(text)
    except SpeculorError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_toolbench_parser(sub) -> None:
    """`speculor toolbench`."""
    tb = sub.add_parser("toolbench", help="tool calls (BFCL) and JSON schemas through speculor serve and llama-server")
    tb.add_argument("--sets", default="bfcl-simple,bfcl-multiple,bfcl-parallel,schema",
                    help="comma-separated: bfcl-simple, bfcl-multiple, bfcl-parallel, schema (bench/toolcalls.py)")
    tb.add_argument("--limit", type=int, default=100, help="questions per set (the first ones)")
    tb.add_argument("--rows", default="plain,default,suffix,free,llama-server,llama-server ngram-mod,llama-server -md",
                    help="comma-separated rows (commands/toolbench.py ROWS)")
    tb.add_argument("--rounds", type=int, default=2, help="rounds over the questions (free and warm-up: one)")
    tb.add_argument("--max-tokens", type=int, default=256)
    tb.add_argument("--threads", type=int, default=2, help="each server's threads")
    tb.add_argument("--clients", type=int, default=1, help="then each row once more with this many clients at "
                    "once (rows named row@N; llama-server started with -np N)")
    tb.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server's binary (default: the one "
                    "`make llama-server` built)")
    tb.add_argument("--out", default="runs/toolbench", help="folder for answers.jsonl, table.md and the logs")


def _add_ray_args(s: argparse.ArgumentParser) -> None:
    """`speculor serve --ray`: the same app on Ray Serve (serving/ray_serve.py); each option is RaySettings' (the
    names: commands.RAY_ARGS)."""
    r = s.add_argument_group("Ray Serve", "with --ray: an ingress deployment with this server's routes in front of "
                             "replicas that each hold the model pair (docs/ray.md)")
    r.add_argument("--ray", action="store_true", help="serve on Ray Serve (a Ray instance started here, or "
                   "--ray-address's cluster)")
    r.add_argument("--ray-address", default=None, help="an existing Ray cluster (e.g. ray://head:10001 or auto)")
    r.add_argument("--metrics-port", type=int, default=8080, help="a Ray instance started here exports the metrics "
                   "on this port (/metrics)")
    r.add_argument("--replicas", type=int, help="replicas of the model pair (default 1)")
    r.add_argument("--min-replicas", type=int, help="autoscaling: fewest replicas (with --max-replicas)")
    r.add_argument("--max-replicas", type=int, help="autoscaling: most replicas")
    r.add_argument("--target-ongoing-requests", type=float, help="autoscaling: requests per replica it aims at "
                   "(default: --max-batch)")
    r.add_argument("--replica-cpus", type=float, help="CPUs a replica asks Ray for (default: --threads, else 1)")
    r.add_argument("--replica-memory-gib", type=float, help="memory a replica asks Ray for (default: the pair's "
                   "weight files + 1 GiB)")
    r.add_argument("--replica-gpus", type=float, help="GPUs a replica asks Ray for (default: 1 on cuda)")
    r.add_argument("--max-queued-requests", type=int, help="requests that may wait at the ingress for a replica "
                   "(default: no bound); more get 429")
    r.add_argument("--drain-s", type=float, help="a stopped replica waits this long for its requests (default 300)")


def _add_train_head_parser(sub) -> None:
    t = sub.add_parser("train-head", help="SpecDec++: build training data on ShareGPT and train the acceptance head",
                       description="Defaults: those of speculor.methods.specdecpp_data.DataConfig and "
                       "speculor.methods.specdecpp_train.TrainConfig.")
    t.add_argument("--sequences", type=int, help="ShareGPT conversations used (data size; default 64, ~20-40 s each "
                   "on a 2-core CPU, cached and resumable)")
    t.add_argument("--max-len", type=int, help="prompt + reply tokens per sequence (256)")
    t.add_argument("--max-prompt", type=int, help="skip prompts longer than this (128 tokens)")
    t.add_argument("--mixing-ratio", type=float, help="r: share of true reply tokens in Z (0.15)")
    t.add_argument("--heldout", type=float, help="share of sequences held out (0.15)")
    t.add_argument("--layers", type=int, help="residual blocks of the head (3)")
    t.add_argument("--epochs", type=int, help="(8; the best held-out epoch is kept)")
    t.add_argument("--lr", type=float, help="(5e-5)")
    t.add_argument("--batch-size", type=int, help="(256)")
    t.add_argument("--weight", type=float, dest="weight_mismatch", help="w: loss weight of the reject class (6)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None, help="head file (default: <cache>/specdecpp/head--<draft>.safetensors)")
    t.add_argument("--plot", default=None, help="calibration PNG (default: next to the head)")
    _add_model_args(t, backend="torch")  # the head reads the draft's hidden states through its transformers model


def _add_boost_tune_parser(sub) -> None:
    t = sub.add_parser("boost-tune", help="SpecInfer's boost-tuning: train a pool of cheap heads on the target's "
                       "hidden states (the eagle and specinfer:drafters=boosted strategies)")
    t.add_argument("--target", default="default", help="target model: 'default', a folder, a .gguf file")
    t.add_argument("--feature-source", choices=("llama.cpp", "transformers"), default="llama.cpp",
                   help="what computes the target's features: llama.cpp (the GGUF on this CPU, --threads; the draft's "
                   "acceptance is measured beside the heads'), transformers (batched on --device: a GPU)")
    t.add_argument("--draft", default="default", help="llama.cpp: the draft compared on the held-out answers; 'none'")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--device", default="cpu", help="cpu or cuda")
    t.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    t.add_argument("--conversations", type=int, default=400, help="ShareGPT conversations teacher-forced")
    t.add_argument("--max-len", type=int, default=1024, help="tokens per conversation at most")
    t.add_argument("--selfgen", type=int, default=64, help="ShareGPT prompts the target answers itself (greedy)")
    t.add_argument("--heldout", type=int, default=40, help="MT-Bench and HumanEval prompts each, held out")
    t.add_argument("--answer-tokens", type=int, default=128, help="tokens of each held-out answer")
    t.add_argument("--selfgen-tokens", type=int, default=256, help="tokens of each self-generated answer")
    t.add_argument("--vocab", type=int, default=8192, help="the head's vocabulary: the N most frequent tokens")
    t.add_argument("--width", type=int, default=256)
    t.add_argument("--ffn", type=int, default=512)
    t.add_argument("--blocks", type=int, default=2)
    t.add_argument("--ssms", type=int, default=3, help="heads in the pool")
    t.add_argument("--steps", type=int, default=2000, help="optimizer steps per head")
    t.add_argument("--batch", type=int, default=512)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--hit-weight", type=float, default=0.1, help="boosting: weight of positions already predicted")
    t.add_argument("--minutes", type=float, default=None, help="stop each head's training after this long")
    t.add_argument("--tokens-per-batch", type=int, default=8192, help="teacher forcing: tokens per forward")
    t.add_argument("--prepared", default=None, help="read the token ids from this file (--save-prepared)")
    t.add_argument("--save-prepared", default=None, help="write the token ids to this file and stop")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None, help="the pool's folder (default: <cache>/boosted/<target>)")
    t.add_argument("--evaluate", default=None, metavar="POOL", help="train nothing: the held-out acceptance by depth "
                   "of this pool's heads (and of --draft) with this feature source's features")


def _add_tune_threshold_parser(sub) -> None:
    u = sub.add_parser("tune-threshold", help="SpecDec++: pick the stopping threshold h by measured tokens/s")
    u.add_argument("--head", default=None, help="head file (default: the packaged head)")
    u.add_argument("--grid", default="0.5,0.7,0.8,0.9,0.95,0.98", help="comma-separated thresholds to try")
    u.add_argument("--temperatures", default="0,0.7", help="comma-separated; one threshold per temperature")
    u.add_argument("--top-p", type=float, default=1.0)
    u.add_argument("--sets", default="mtbench,humaneval")
    u.add_argument("--prompts", type=int, default=4, help="number of prompts")
    u.add_argument("--skip", type=int, default=6, help="skip the first prompts (the bench's) to keep them apart")
    u.add_argument("--max-new-tokens", type=int, default=48)
    u.add_argument("--k-min", type=int, default=2)
    u.add_argument("--k-max", type=int, default=20)
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--out", default=None, help="thresholds JSON (default: the cache, where `specdecpp` looks)")
    _add_model_args(u, backend="torch")  # specdecpp checks its head against the draft's transformers config


def _add_refit_priors_parser(sub) -> None:
    r = sub.add_parser("refit-priors", help="recompute the drafters' fitted priors (data/priors.json) from the plain "
                       "answers of bench runs; no model is loaded")
    r.add_argument("--records", nargs="+", required=True, metavar="FILE", help="records.jsonl of `speculor bench` runs "
                   "holding plain answers (one run a file; data/priors.json names the files each prior was fitted on)")
    r.add_argument("--questions", action="append", default=[], metavar="FILE", help="a JSONL prompt file the records' "
                   "prompts came from, beyond the built-in sets (repeatable)")
    r.add_argument("--temperature", type=float, default=0.0, help="the plain answers' temperature (default 0)")
    r.add_argument("--tokenizer", default=None, metavar="DIR", help="the target's model folder, to encode the prompts "
                   "as the bench did (default: the embedded target's)")
    r.add_argument("--machine", default="not given (--machine)", help="the machine and backend that decoded the "
                   "answers, recorded with the fit")
    r.add_argument("--priors", default=None, metavar="FILE", help="the priors file refitted (default: the packaged "
                   "one)")
    r.add_argument("--out", default=None, metavar="FILE", help="where to write it (default: over --priors)")
    r.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")


COMMANDS = {"generate": generate.run, "bench": bench.run, "calibrate": calibrate.run, "profile": profile.run,
            "train-head": train_head.run, "boost-tune": boost_tune.run, "tune-threshold": tune_threshold.run,
            "refit-priors": refit_priors.run, "fetch-models": fetch_models.run, "serve": serve.run,
            "loadtest": loadtest.run, "toolbench": toolbench.run}


def _unhonoured(ap: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first llama-server flag that `speculor serve` does not honour in `argv` (serve's command line), if any."""
    if argv[:1] != ["serve"]:
        return None
    commands_ = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    serve_ = commands_.choices["serve"]
    takes_value = {o for a in serve_._actions if a.nargs != 0 for o in a.option_strings}
    return llama_flags.unhonoured(argv[1:], takes_value)


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)  # as given (a manifest records its command)
    ap = _parser()
    if flag := _unhonoured(ap, given):
        print(f"speculor: error: {flag} is a llama-server flag that `speculor serve` does not honour (no flag is "
              f"ignored silently): leave it out. Honoured: -m, -md, -c, -np, -t, -tb, -n, -a, --host, --port, --jinja, "
              "--api-key, --api-key-file, --ssl-key-file, --ssl-cert-file, -to", file=sys.stderr)
        return 2
    args = ap.parse_args(given)
    args.argv = given
    try:
        COMMANDS[args.command](args)
    except SpeculorError as exc:
        print(f"speculor: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
