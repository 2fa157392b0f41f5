"""What a speculor application on Ray Serve is made of (`RaySettings`: the pair, the engine, the replicas and what each
asks Ray for) and the checks made before deploying it: its strategy, and that some node can hold a replica."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from speculor.errors import SpeculorError
from speculor.serving.security import MAX_BODY_BYTES, TIMEOUT_S, Guard

if TYPE_CHECKING:
    from speculor.runtime.spec import PairSpec


class RaySettings(BaseModel):
    """What `speculor serve --ray` and a `serve run`/`serve deploy` config's args set (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid")
    # the pair, as `speculor serve` names it (`pair_spec`: runtime.spec.PairSpec.named)
    target: str = "default"
    draft: str = "default"  # "none" for no draft
    backend: Literal["auto", "torch", "llama.cpp"] = "auto"  # auto: each node's measured choice (runtime/choice.py)
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kernels: Literal["fast", "eager"] = "fast"
    threads: int | None = Field(None, ge=1)
    calls: Literal["exact", "vector", "batched"] = "exact"  # llama.cpp's calls (runtime/llama/model.py CALLS)
    draft_vocab: int | None = None
    offload: bool = False
    context: int | None = Field(None, ge=16)  # a request's context (llama-server's -c; runtime/spec.py)
    # the engine
    strategy: str | None = None  # None: the default strategy (drafters/registry.py `_default`)
    options: dict[str, Any] = {}
    queue_size: int = Field(64, ge=1)
    max_batch: int = Field(16, ge=1, le=256)
    max_queued_requests: int = Field(-1, ge=-1)  # waiting at an ingress for a replica; -1: no bound (Ray's default)
    n_predict: int | None = Field(None, ge=1)  # new tokens of a request that asks for no number (llama-server's -n)
    alias: str | None = None  # the model name the server reports (default: the target's)
    # the ingress's network safety (serving/security.py `Guard`)
    api_keys: list[str] = Field([], repr=False)
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1)
    timeout: float = Field(TIMEOUT_S, gt=0)
    # Ray Serve
    replicas: int = Field(1, ge=1)
    min_replicas: int | None = Field(None, ge=0)  # autoscaling when max_replicas is set
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)  # default: max_batch
    replica_cpus: float | None = Field(None, ge=0)  # default: threads (1 if not given)
    replica_memory_gib: float | None = Field(None, ge=0)  # default: the pair's weight files + 1 GiB, where known
    replica_gpus: float | None = Field(None, ge=0)  # default: 1 on cuda
    ingress_replicas: int = Field(1, ge=1)
    drain_s: float = Field(300.0, ge=0)  # a stopped replica's wait for its requests to finish

    @model_validator(mode="after")
    def _autoscaling(self) -> RaySettings:
        if (self.min_replicas is not None or self.target_ongoing_requests is not None) and self.max_replicas is None:
            raise ValueError("autoscaling needs max_replicas (min_replicas and target_ongoing_requests go with it)")
        if self.max_replicas is not None and (self.min_replicas or 0) > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self

    @classmethod
    def of(cls, args: dict[str, Any]) -> RaySettings:
        """Settings from a dict (e.g. `serve run` args, strings included); a bad one is a SpeculorError."""
        try:
            return cls.model_validate(args)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "settings"
            raise SpeculorError(f"Ray Serve settings: {where}: {first['msg']}") from None

    def replica_args(self) -> dict[str, Any]:
        """What a replica is made from: the pair and the engine, not the scaling (a change of scale then restarts no
        replica: Ray Serve starts a new version only when these change)."""
        return self.model_dump(include={"target", "draft", "backend", "device", "dtype", "kernels", "threads",
                                        "calls", "draft_vocab", "offload", "context", "strategy", "options",
                                        "queue_size", "max_batch", "n_predict", "alias"})

    def pair_spec(self) -> PairSpec:
        """The pair a replica loads (`speculor.load_pair` of it; backend auto: each node's own choice)."""
        from speculor.runtime.spec import PairSpec

        return PairSpec.named(**self.model_dump(include={"target", "draft", "backend", "device", "dtype", "kernels",
                                                         "threads", "calls", "draft_vocab", "offload", "context"}))

    def guard(self) -> Guard:
        """The ingress's API keys and limits."""
        return Guard(tuple(self.api_keys), self.max_body_bytes, self.timeout)

    def actor_options(self) -> dict[str, Any]:
        """What each replica asks Ray for: CPUs, memory for the pair, a GPU on cuda."""
        cpus = self.replica_cpus if self.replica_cpus is not None else float(self.threads or 1)
        gpus = self.replica_gpus if self.replica_gpus is not None else float(self.device.startswith("cuda"))
        gib = self.replica_memory_gib if self.replica_memory_gib is not None else pair_memory_gib(self)
        options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus}
        if gib:
            options["memory"] = int(gib * 2**30)
        return options

    def scaling(self) -> dict[str, Any]:
        if self.max_replicas is None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas or 0, "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": self.target_ongoing_requests or self.max_batch}}


def pair_memory_gib(s: RaySettings) -> float | None:
    """The pair's weight files as this machine has them + 1 GiB (caches, runtime); None where they are not here."""
    from speculor.runtime import embedded

    total = 0
    for name in embedded.named(s.target, None if s.draft == "none" else s.draft):
        if name is None:
            continue
        if name in embedded.EMBEDDED and s.backend == "llama.cpp":
            files = [f for f in (embedded.gguf_path(name),) if f.exists()]
        elif name in embedded.EMBEDDED:
            files = list(embedded.model_dir(name).glob("*.safetensors"))
        else:
            path = Path(name).expanduser()
            files = [path] if path.is_file() else list(path.glob("*.safetensors")) + list(path.glob("*.gguf"))
        if not files:
            return None
        total += sum(f.stat().st_size for f in files)
    return round(total / 2**30 + 1.0, 2)


def check_strategy(s: RaySettings) -> None:
    """The registry's check of the strategy and its options (imports torch), before anything is deployed."""
    from speculor.drafters.registry import check_options

    check_options(s.strategy or "default", s.options)


def check_fits(s: RaySettings) -> None:
    """Refuse, before deploying, replicas that no node of the cluster could hold (Ray would wait for one forever)."""
    need = s.actor_options()
    want = {"CPU": need["num_cpus"], "GPU": need["num_gpus"], "memory": need.get("memory", 0)}
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not any(all(n.get(k, 0) >= v for k, v in want.items() if v) for n in nodes):
        have = [{k: round(n.get(k, 0) / (2**30 if k == "memory" else 1), 2) for k in want} for n in nodes]
        raise SpeculorError(f"no node of this Ray cluster can hold a replica: each asks for {need['num_cpus']:g} CPUs, "
                            f"{need['num_gpus']:g} GPUs and {want['memory'] / 2**30:.2f} GiB of memory; the nodes "
                            f"have {have} (memory in GiB). Give --replica-cpus/--replica-memory-gib/--threads, or add "
                            "nodes")


def port_free(port: int, flag: str) -> None:
    """Refuse a port that something here already listens on (Ray's metrics agent would fail obscurely)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            raise SpeculorError(f"{flag} {port} is not free here ({exc.strerror}): give another port") from None
