"""llama-server's command line as `speculor serve` reads it: the flags that mean the same thing here are aliases of
serve's own options (cli.py adds them), and every other llama-server flag is refused by name, never ignored.

FLAGS is every spelling `llama-server --help` lists (llama.cpp commit 0c1e570, the source the installed
llama-cpp-python vendors), and the older --mlock/--mmap/--no-mmap. HONOURED are those `speculor serve` takes, each
meaning here what it means there (docs/usage.md, "A drop-in for llama-server").
"""

from __future__ import annotations

from collections.abc import Collection

FLAGS = frozenset("""
    -h --help --usage --version -cl --cache-list --completion-bash -t --threads -tb --threads-batch -C --cpu-mask -Cr
    --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb --cpu-range-batch --cpu-strict-batch --prio-batch
    --poll-batch -c --ctx-size -n --predict --n-predict -b --batch-size -ub --ubatch-size --keep --swa-full -fa
    --flash-attn --perf --no-perf -e --escape --no-escape --rope-scaling --rope-scale --rope-freq-base
    --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast -kvo
    --kv-offload -nkvo --no-kv-offload --repack -nr --no-repack --no-host -ctk --cache-type-k -ctv --cache-type-v -dt
    --defrag-thold --rpc -lm --load-mode -lzm --lazy-mode --numa -dev --device --list-devices -ot --override-tensor
    -cmoe --cpu-moe -ncmoe --n-cpu-moe -ncffn --n-cpu-ffn -ngl --gpu-layers --n-gpu-layers -sm --split-mode -ts
    --tensor-split -mg --main-gpu -fit --fit -fitt --fit-target -fitc --fit-ctx --check-tensors --override-kv
    --op-offload --no-op-offload --lora --lora-scaled --control-vector --control-vector-scaled
    --control-vector-layer-range -m --model -mu --model-url -dr --docker-repo -hf -hfr --hf-repo -hff --hf-file -hft
    --hf-token --log-disable --log-file --log-jsonl --no-log-jsonl --log-colors -v --verbose --log-verbose --offline
    -lv --verbosity --log-verbosity --log-prefix --no-log-prefix --log-timestamps --no-log-timestamps
    --spec-draft-type-k -ctkd --cache-type-k-draft --spec-draft-type-v -ctvd --cache-type-v-draft --samplers -s --seed
    --sampler-seq --sampling-seq --ignore-eos --temp --temperature --top-k --top-p --min-p --top-nsigma --top-n-sigma
    --xtc-probability --xtc-threshold --typical --typical-p --repeat-last-n --repeat-penalty --presence-penalty
    --frequency-penalty --dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker
    --adaptive-target --adaptive-decay --dynatemp-range --dynatemp-exp --mirostat --mirostat-lr --mirostat-ent -l
    --logit-bias --grammar --grammar-file -j --json-schema -jf --json-schema-file -bs --backend-sampling
    --spec-draft-hf -hfd -hfrd --hf-repo-draft --spec-draft-threads -td --threads-draft --spec-draft-threads-batch
    -tbd --threads-batch-draft --spec-draft-cpu-mask -Cd --cpu-mask-draft --spec-draft-cpu-range -Crd
    --cpu-range-draft --spec-draft-cpu-strict --cpu-strict-draft --spec-draft-prio --prio-draft --spec-draft-poll
    --poll-draft --spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft --spec-draft-cpu-strict-batch
    --cpu-strict-batch-draft --spec-draft-prio-batch --prio-batch-draft --spec-draft-poll-batch --poll-batch-draft
    --spec-draft-override-tensor -otd --override-tensor-draft --spec-draft-cpu-moe -cmoed --cpu-moe-draft
    --spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft --spec-draft-n-max --spec-draft-n-min
    --spec-synth-len --spec-synth-rates --spec-draft-p-split --draft-p-split --spec-draft-p-min --draft-p-min
    --spec-draft-backend-sampling --no-spec-draft-backend-sampling --spec-draft-device -devd --device-draft
    --spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft --spec-draft-model -md --model-draft --spec-type
    --spec-ngram-mod-n-min --spec-ngram-mod-n-max --spec-ngram-mod-n-match --spec-ngram-simple-size-n
    --spec-ngram-simple-size-m --spec-ngram-simple-min-hits --spec-ngram-map-k-size-n --spec-ngram-map-k-size-m
    --spec-ngram-map-k-min-hits --spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-min-hits
    --draft --draft-n --draft-max --draft-min --draft-n-min --spec-ngram-size-n --spec-ngram-size-m
    --spec-ngram-min-hits -lcs --lookup-cache-static -lcd --lookup-cache-dynamic --kv-unified-per-slot -ctxcp
    --ctx-checkpoints --swa-checkpoints -cms --checkpoint-min-step -cram --cache-ram -kvu --kv-unified -no-kvu
    --no-kv-unified --cache-idle-slots --no-cache-idle-slots --context-shift --no-context-shift -r --reverse-prompt
    -sp --special --warmup --no-warmup --spm-infill --pooling -np --parallel -cb --cont-batching -nocb
    --no-cont-batching -mm --mmproj -mmu --mmproj-url --mmproj-auto --no-mmproj --no-mmproj-auto --mmproj-offload
    --no-mmproj-offload -mmdev --mmproj-device --image-min-tokens --image-max-tokens --mtmd-batch-max-tokens
    --video-fps --video-timestamp-interval --video-ffmpeg-dir -a --alias --tags --embd-normalize --host --port
    --reuse-port --path --cors-origins --cors-methods --cors-headers --cors-credentials --no-cors-credentials
    --api-prefix --ui-config --webui-config --ui-config-file --webui-config-file --ui-mcp-proxy --webui-mcp-proxy
    --no-ui-mcp-proxy --no-webui-mcp-proxy --tools --tools-runtime --mcp-servers-config --mcp-servers-json -ag --agent
    -no-ag --no-agent --ui --webui --no-ui --no-webui --embedding --embeddings --rerank --reranking --api-key
    --api-key-file --ssl-key-file --ssl-cert-file --chat-template-kwargs -to --timeout --sse-ping-interval
    --threads-http --cache-prompt --no-cache-prompt --cache-reuse --metrics --props --slots --no-slots
    --slot-save-path --media-path --models-dir --models-preset --models-max --models-autoload --no-models-autoload
    --jinja --no-jinja --reasoning-format -rea --reasoning --reasoning-effort --reasoning-budget
    --reasoning-budget-message --reasoning-preserve --no-reasoning-preserve --chat-template --chat-template-file
    --skip-chat-parsing --no-skip-chat-parsing --prefill-assistant --no-prefill-assistant -sps
    --slot-prompt-similarity --lora-init-without-apply --sleep-idle-seconds --log-prompts-dir --embd-gemma-default
    --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default --fim-qwen-7b-spec --fim-qwen-14b-spec
    --fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default --vision-gemma-4b-default
    --vision-gemma-12b-default --spec-default --mlock --mmap --no-mmap
""".split())

HONOURED = frozenset({
    "-m", "--model", "-md", "--model-draft", "--spec-draft-model", "-c", "--ctx-size", "-np", "--parallel", "-t",
    "--threads", "-tb", "--threads-batch", "-n", "--predict", "--n-predict", "--host", "--port", "--jinja", "-a",
    "--alias", "--api-key", "--api-key-file", "--ssl-key-file", "--ssl-cert-file", "-to", "--timeout", "-h", "--help",
    "--draft", "--device",  # serve's own options (the draft model, the torch device), spelled as llama-server's
})


def unhonoured(argv: list[str], takes_value: Collection[str]) -> str | None:
    """The first llama-server flag in `argv` (serve's arguments) that `speculor serve` does not honour, else None.
    `takes_value`: serve's own option strings that take a value (the value after one is skipped: a key may start with
    a dash)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in FLAGS and flag not in HONOURED:
            return flag
        skip = arg in takes_value
    return None
