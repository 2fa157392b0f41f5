"""`speculor serve`: the OpenAI-compatible HTTP server (serving/app.py), or with --ray the same app on Ray Serve
(serving/ray_serve.py). llama-server's spellings of the same settings are aliases of its options (cli.py; the flags it
refuses: commands/llama_flags.py)."""

from __future__ import annotations

from typing import Any

from speculor import commands
from speculor.commands import PAIR_OPTIONS, RAY_ARGS, Args
from speculor.errors import SpeculorError


def run(args: Args) -> None:
    from speculor.serving.app import serve

    given = [name for name in RAY_ARGS if getattr(args, name, None) is not None]
    if given and not (args.ray or args.ray_address):
        raise SpeculorError(f"--{given[0].replace('_', '-')} is a Ray Serve option: add --ray")
    options = commands.strategy_options(args)  # refused before the pair is loaded (or Ray started)
    server = server_options(args)  # and so are these
    if args.ray or args.ray_address:  # the same app on Ray Serve, replicas loading the pair
        return on_ray(args, args.strategy, options, given, server)
    pair = commands.load(args)
    serve(pair, host=args.host, port=args.port, strategy=args.strategy, queue_size=args.queue_size,
          max_batch=args.max_batch, **server, **options)


def server_options(args: Args) -> dict[str, Any]:
    """`serve`'s keyword arguments beside the pair, the strategy and the queue, as given (those not given are left
    out: the server's own defaults apply): the network's safety (a `Guard` where a key or a limit is given), TLS,
    the default n_predict and the model's name. Raises SpeculorError for a bad one."""
    from speculor.serving.security import Guard, read_keys

    tb = getattr(args, "threads_batch", None)
    if tb is not None and tb != args.threads:
        raise SpeculorError(f"-tb/--threads-batch {tb}: one thread count decodes and fills prompts here; give it equal "
                            f"to -t/--threads ({args.threads}), or leave it out")
    keys = read_keys(args.api_key or (), args.api_key_file)
    limits = {k: v for k, v in (("max_body_bytes", args.max_body_bytes), ("timeout", args.timeout)) if v is not None}
    out: dict[str, Any] = {"guard": Guard(keys, **limits)} if keys or limits else {}
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SpeculorError("TLS needs both --ssl-key-file and --ssl-cert-file")
    if args.n_predict is not None and args.n_predict != -1 and args.n_predict < 1:
        raise SpeculorError(f"-n/--n-predict must be -1 (each route's default) or at least 1, got {args.n_predict}")
    given = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "model": args.alias,
             "timeout_keep_alive": args.timeout_keep_alive,
             "n_predict": None if args.n_predict == -1 else args.n_predict}
    return out | {k: v for k, v in given.items() if v is not None}


def on_ray(args: Args, strategy: str | None, options: dict[str, Any], ray_args: list[str],
           server: dict[str, Any]) -> None:
    """`speculor serve --ray`: its arguments (`ray_args` the Ray options given, `server` the server's options) as
    RaySettings, then Ray Serve."""
    from speculor.serving.ray_config import RaySettings
    from speculor.serving.ray_serve import run as run_on_ray

    names = ("target", "draft", *PAIR_OPTIONS, "queue_size", "max_batch", *ray_args)
    guard = server.pop("guard", None)
    limits = {} if guard is None else {"api_keys": list(guard.api_keys), "max_body_bytes": guard.max_body_bytes,
                                       "timeout": guard.timeout}
    engine = {name: server.pop(k) for k, name in (("n_predict", "n_predict"), ("model", "alias")) if k in server}
    settings = RaySettings.of({n: getattr(args, n) for n in names} | {"strategy": strategy, "options": options}
                              | limits | engine)
    run_on_ray(settings, host=args.host, port=args.port, address=args.ray_address, metrics_port=args.metrics_port,
               **server)
