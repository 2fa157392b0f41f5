"""`speculor boost-tune`: SpecInfer's boost-tuning of a pool of EAGLE-style heads (methods/boost_tune.py)."""

from __future__ import annotations

import json

from speculor.commands import Args


def run(args: Args) -> None:
    import datetime
    import platform
    import shlex
    from pathlib import Path

    import torch

    from speculor.methods import boost_data as bd
    from speculor.methods import boost_tune as bt
    from speculor.runtime import embedded
    from speculor.runtime.assets import cache_dir, slug
    from speculor.runtime.eagle_head import EagleConfig
    from speculor.runtime.spec import torch_dtype

    args.target = embedded.named(args.target, None)[0]
    if args.prepared:
        data = torch.load(args.prepared)
    else:
        from speculor.runtime.load import load_tokenizer

        data = bd.prepare(load_tokenizer(args.target), conversations=args.conversations, max_len=args.max_len,
                          selfgen=args.selfgen, heldout=args.heldout, vocab=args.vocab)
    if args.save_prepared:
        torch.save(data, args.save_prepared)
        print(f"saved the prepared ids to {args.save_prepared}: {len(data['train'])} conversations, "
              f"{sum(len(i) for i, _ in data['train'])} tokens, {len(data['selfgen'])} self-generation prompts")
        return
    dtype = torch_dtype(args.dtype, args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    source, draft = _feature_source(args, dtype)
    if args.evaluate:
        from speculor.runtime.eagle_head import load_pool

        heads, _ = load_pool(Path(args.evaluate))
        table = bt.evaluate_pool(source, data, heads, answer_tokens=args.answer_tokens, draft=draft)
        print(json.dumps(table, indent=1))
        return
    cfg = EagleConfig(source.hidden_size, width=args.width, ffn=args.ffn, blocks=args.blocks, vocab=len(data["ids"]))
    train = bt.TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, hit_weight=args.hit_weight,
                           seconds=args.minutes * 60 if args.minutes else None)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    plan = bt.Plan(cfg, train, ssms=args.ssms, seed=args.seed, manifest={
        "what": "a pool of EAGLE-style heads boost-tuned on the target's own distribution (SpecInfer)",
        "target": args.target, "feature_source": args.feature_source, "dtype": str(dtype).removeprefix("torch."),
        "where": f"{device}, torch {torch.__version__}", "made": datetime.date.today().isoformat(),
        "command": "speculor " + shlex.join(getattr(args, "argv", ["boost-tune"]))})
    torch.manual_seed(args.seed)
    out = Path(args.out) if args.out else cache_dir() / "boosted" / slug(Path(args.target).name)
    manifest = bt.run(source, data, plan, out, answer_tokens=args.answer_tokens, dtype=dtype,
                      draft=draft, selfgen_tokens=args.selfgen_tokens)
    print(json.dumps(manifest["heldout"], indent=1))
    print(f"saved the pool of {args.ssms} heads to {out} ({manifest['seconds']:.0f} s): use it with --heads {out}")


def _feature_source(args: Args, dtype):
    """(the target's feature source, a draft model to compare with or None)."""
    import torch

    from speculor.methods import boost_data as bd
    from speculor.runtime import embedded

    if args.feature_source == "transformers":
        from speculor.runtime.load import load_model

        model, _ = load_model(args.target, device=args.device, dtype=dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        return bd.HFSource(model, tokens_per_batch=args.tokens_per_batch), None
    from speculor.runtime.llama.model import LlamaModel
    from speculor.runtime.prepare import gguf_file

    threads = args.threads or torch.get_num_threads()
    target = LlamaModel(gguf_file(args.target), threads=threads)
    draft = None if args.draft == "none" else LlamaModel(gguf_file(embedded.named("default", args.draft)[1]),
                                                         threads=threads)
    return bd.BackendSource(target), draft
