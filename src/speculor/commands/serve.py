"""`speculor serve`: the OpenAI-compatible HTTP server (serving/app.py), or with --ray the same app on Ray Serve
(serving/ray_serve.py)."""

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
    if args.ray or args.ray_address:  # the same app on Ray Serve, replicas loading the pair
        return on_ray(args, args.strategy, options, given)
    pair = commands.load(args)
    serve(pair, host=args.host, port=args.port, strategy=args.strategy, queue_size=args.queue_size,
          max_batch=args.max_batch, **options)


def on_ray(args: Args, strategy: str | None, options: dict[str, Any], ray_args: list[str]) -> None:
    """`speculor serve --ray`: its arguments (`ray_args` the Ray options given) as RaySettings, then Ray Serve."""
    from speculor.serving.ray_config import RaySettings
    from speculor.serving.ray_serve import run as run_on_ray

    names = ("target", "draft", *PAIR_OPTIONS, "queue_size", "max_batch", *ray_args)
    settings = RaySettings.of({n: getattr(args, n) for n in names} | {"strategy": strategy, "options": options})
    run_on_ray(settings, host=args.host, port=args.port, address=args.ray_address, metrics_port=args.metrics_port)
