"""What each job-file field means, by its dotted path: the words of the job-file reference (docs/reference/job-file.md,
generated from the schema at build time) and of the JSON Schema `raymesh schema` prints, which editors show beside a
field.

Types, defaults and bounds come from the pydantic sections themselves; only the meaning lives here. A field declared
with ``Field(description=...)`` needs no entry (its description wins); `tests/unit/test_docs_reference.py` fails when
a field has neither, or when an entry here names no field. Links are relative to docs/reference/.
"""

from __future__ import annotations

FIELD_DOCS: dict[str, str] = {
    'name': 'job name; `run_dir` defaults to `runs/<name>`',
    'run_dir': (
        'Unset: `runs/<name>`. where checkpoints go (unless `checkpoint.dir` is set), records, reports; a local or '
        'shared path, or an object-store URL (`s3://BUCKET/PATH`, `gs://...`, `file:///abs/path`): its files are '
        'written in a local staging directory and copied up, its checkpoints written to `<run_dir>/checkpoints` in '
        'the bucket directly (see [Object storage](../guides/object-storage.md))'
    ),
    'model.vocab_size': (
        "vocabulary (256: bytes); at least the data's (the manifest's `vocab_size`, printed by `prepare-data`), else "
        'refused before start. With `parallel.tp` > 1 the embedding and head are sharded over the vocabulary, so the '
        'model gets `vocab_size` rounded up to a multiple of tp; the padded ids never occur in the data, so they are '
        'never targeted (their logits are only pushed down), and the single-process reference builds the same padded '
        'model. `export-hf` leaves the padded rows out: its `config.json`, embedding and head have `vocab_size` rows, '
        "the tokenizer's. A checkpoint resumes at another tp only when both round to the same size; another is "
        'refused before start, naming the tp values that do. A `model.init_from` vocabulary is not padded (the padded '
        "head rows would add logits `transformers`' model has not, changing the loss): tp must divide it, else "
        'refused before start'
    ),
    'model.d_model': 'transformer size',
    'model.n_layers': 'transformer size',
    'model.n_heads': 'transformer size',
    'model.d_ff': "Unset: 4·d_model (gpt), Llama's rule (llama). MLP hidden size (Llama's `intermediate_size`)",
    'model.seq_len': 'tokens per sample',
    'model.positions': '`rotary` or `learned`',
    'model.attention_mask': (
        '`causal`, or `document`: a token attends only to earlier tokens of its own document (block-causal, Llama '
        "3's; see [Document masking](../guides/long-context.md#document-masking)). Documents are counted by the "
        "data's end-of-document id (its manifest's `eos_id`); data written as bare rows has none and is refused "
        'before start, as are the asynchronous pipelines; every `cp_impl` and `train.compile` take it, and '
        '`positions: learned` restarts at each document'
    ),
    'model.norm_eps': 'RMSNorm epsilon, init std (residual projections scaled by 1/√(2·n_layers))',
    'model.init_std': 'RMSNorm epsilon, init std (residual projections scaled by 1/√(2·n_layers))',
    'model.arch': (
        'model family from the registry (`workers/model/registry.py`): `gpt` or `llama` (see [Llama, Mistral and Qwen '
        'models and Hugging Face checkpoints](../guides/hugging-face.md)); `hf`: any other Hugging Face causal LM, set '
        'by `model.init_from`, dp/ZeRO only ([seed techniques](../guides/seeds-a.md))'
    ),
    'model.n_kv_heads': (
        'Unset: `n_heads`. llama: key/value heads (grouped-query attention); must divide `n_heads`, and `parallel.tp` '
        'must divide it'
    ),
    'model.rope_theta': 'llama: rotary base',
    'model.rope_scaling': (
        'llama: Llama-3 frequency scaling `{factor, low_freq_factor, high_freq_factor, '
        'original_max_position_embeddings}` (defaults 8, 1, 4, 8192)'
    ),
    'model.rope_scaling.factor': (
        "Llama 3.1's rotary frequency scaling: how far the context is stretched (frequencies below "
        "`low_freq_factor`'s band are divided by it)"
    ),
    'model.rope_scaling.low_freq_factor': (
        "Llama 3.1's rotary scaling: wavelengths longer than `original_max_position_embeddings / low_freq_factor` are "
        'scaled by `factor`'
    ),
    'model.rope_scaling.high_freq_factor': (
        "Llama 3.1's rotary scaling: wavelengths shorter than `original_max_position_embeddings / high_freq_factor` "
        'are kept; between the two bands they are blended'
    ),
    'model.rope_scaling.original_max_position_embeddings': (
        "Llama 3.1's rotary scaling: the context length the model was pretrained at"
    ),
    'model.multiple_of': (
        'llama without `d_ff`: SwiGLU width = 2/3·4·d_model, × `ffn_dim_multiplier`, rounded up to `multiple_of`'
    ),
    'model.ffn_dim_multiplier': (
        'llama without `d_ff`: SwiGLU width = 2/3·4·d_model, × `ffn_dim_multiplier`, rounded up to `multiple_of`'
    ),
    'model.tie_embeddings': "llama: the output head shares the token embedding's weight (one pipeline stage only)",
    'model.pad_token_id': (
        "llama: the token whose embedding row gets no gradient from the lookup (`transformers`' `padding_idx`; a tied "
        "head's share still reaches it); `init_from` takes it from `config.json`"
    ),
    'model.head_dim': (
        "each attention head's width; null: d_model / n_heads. Qwen3 (and some Mistral/Llama) checkpoints give "
        'another, and q/k/v/o are then n_heads * head_dim wide'
    ),
    'model.qkv_bias': 'biases on the q, k and v projections (not o): Qwen2/2.5',
    'model.qk_norm': 'RMSNorm over head_dim on each query and key head before rotary: Qwen3',
    'model.hf_model_type': (
        'the Hugging Face family an export writes (config.json model_type); init_from sets it from its config.json'
    ),
    'model.moe': (
        'mixture-of-experts feed-forwards (`workers/model/moe.py`); null: a dense model. Figures per MoE layer '
        '(tokens per expert, `drop_fraction`, `balance` = max/mean load, `aux_*` losses) go to `steps.jsonl` under '
        "`moe` and to the `raymesh_moe_*` metrics; the step's `loss` stays the language-model loss"
    ),
    'model.moe.experts': (
        'routed experts per MoE layer (at least 2); blocks `every-1`, `2·every-1`, … get the MoE feed-forward '
        "(`every: 2`: every other block, GShard's layout; at most `n_layers`)"
    ),
    'model.moe.every': (
        'routed experts per MoE layer (at least 2); blocks `every-1`, `2·every-1`, … get the MoE feed-forward '
        "(`every: 2`: every other block, GShard's layout; at most `n_layers`)"
    ),
    'model.moe.router': (
        '`topk` (softmax top-k, gates renormalised, dropless), `noisy_topk` (Shazeer 2017), `gshard` (top-2, random '
        'second expert, capacity), `switch` (top-1, capacity), `expert_choice` (each expert takes its top n·c/e '
        'tokens)'
    ),
    'model.moe.top_k': (
        'Unset: 2 (gshard 2, switch 1). experts per token; at most `experts`; gshard and switch refuse another value, '
        'expert_choice refuses it (set `capacity_factor`)'
    ),
    'model.moe.capacity_factor': (
        '> 0. gshard/switch: capacity per routing group = ceil(factor · tokens · k / experts), assignments beyond it '
        'dropped (first choices before second, earlier tokens first) and the token carried by the residual; '
        'expert_choice: c in k = n·c/e; topk and noisy_topk are dropless'
    ),
    'model.moe.group': (
        'the routing group capacity and auxiliary losses are computed over: `sequence` (results independent of the '
        "layout: dp parity holds, drops included) or `microbatch` (this rank's microbatch: changes with dp and "
        'microbatches)'
    ),
    'model.moe.shared_experts': (
        "always-on experts every token passes (DeepSeek); each expert's hidden width (null: `d_ff`)"
    ),
    'model.moe.d_expert': (
        "always-on experts every token passes (DeepSeek); each expert's hidden width (null: `d_ff`)"
    ),
    'model.moe.aux_loss_weight': (
        "weight of the router's balancing loss (topk/switch: α·E·Σf·P; gshard: mean(f·p); noisy_topk: importance and "
        "load CV²), of ST-MoE's z-loss mean(logsumexp²); computed per group, averaged over groups"
    ),
    'model.moe.z_loss_weight': (
        "weight of the router's balancing loss (topk/switch: α·E·Σf·P; gshard: mean(f·p); noisy_topk: importance and "
        "load CV²), of ST-MoE's z-loss mean(logsumexp²); computed per group, averaged over groups"
    ),
    'model.moe.expert_dropout': (
        "dropout inside the experts only (Switch); the mask is a hash of (seed, layer, expert, the token's stream "
        'position, hidden unit), not a draw from the global RNG, so a run using it is reproduced on any layout (dp, '
        'ep, tp, microbatches)'
    ),
    'model.moe.bias_balancing': (
        "router `topk` only: DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias added to the scores for "
        "the choice (not the gates), moved by the rate after each step against the sign of the expert's load error "
        '(the load summed over dp ranks, so replicas agree)'
    ),
    'model.moe.bias_update_rate': (
        "router `topk` only: DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias added to the scores for "
        "the choice (not the gates), moved by the rate after each step against the sign of the expert's load error "
        '(the load summed over dp ranks, so replicas agree)'
    ),
    'model.moe.norm_topk': (
        "router `topk` only: renormalise the k chosen probabilities to sum to one (Mixtral; Qwen3-MoE's "
        '`norm_topk_prob: true`); false keeps them as the softmax over every expert gave them (`init_from` sets it '
        'from `norm_topk_prob`)'
    ),
    'model.init_from': (
        'a Hugging Face Llama (Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) directory (`config.json` + '
        '`model.safetensors`, or shards with `model.safetensors.index.json`): its `config.json` sets the shape (a '
        'field the job also sets must agree, or an error names both) and each rank loads its own slices of the '
        'weights'
    ),
    'model.lora': 'LoRA fine-tuning (see [LoRA and QLoRA](../guides/fine-tuning.md)); null trains every weight',
    'model.lora.rank': 'adapter rank r, output scale alpha/r, dropout on the adapter input',
    'model.lora.alpha': 'adapter rank r, output scale alpha/r, dropout on the adapter input',
    'model.lora.targets': (
        "Unset: the family's: [wq, wk, wv, wo, w1, w2] (gpt), + w3 (llama). Linear layers to adapt: names or globs "
        'matched against the full name or a dotted suffix'
    ),
    'model.lora.dropout': 'adapter rank r, output scale alpha/r, dropout on the adapter input',
    'model.lora.quantize': "`nf4`: QLoRA's 4-bit base for the adapted layers",
    'model.lora.base_checkpoint': (
        "a full run's checkpoint step directory, or a `.pt` from `export-merged` (not with `model.init_from`, which "
        'gives the base weights itself)'
    ),
    'model.preset': (
        "a named shape: `llama-150m`, `llama-1b` (Llama 3.2 1B's), `llama3-8b`, `llama3-70b`, `llama3-405b` (Llama "
        "3.1's); fields set in the job file override it; not with `init_from`"
    ),
    'data.path': (
        'Unset: required, unless `data.mix` is given. a `prepare-data` output directory, or its copy in object '
        'storage (`s3://BUCKET/PATH`, `gs://...`; see [Object storage](../guides/object-storage.md)); one prepared '
        'with `--format prompt-completion` carries a loss mask: only completion tokens are targets, and an '
        '`eval.path` must carry one too (and the reverse), `parallel.dp_sync: ps` and the asynchronous `pp_schedule`s '
        'are refused with it before start'
    ),
    'data.mix': (
        'a weighted mixture instead of `data.path` (both together are refused): a list of `{path: DIR, weight: W}`, '
        'each path a prepared directory or object-store prefix, each weight `> 0` and finite (normalised; they need '
        'not sum to 1); sources with a loss mask and without may be mixed (every target of one without counts); see '
        '[Streaming data and Ray Data](../guides/data.md)'
    ),
    'data.mix.path': (
        'one source of the mixture: a prepared directory (`raymesh prepare-data --out`) or object-store prefix; each '
        'source listed once'
    ),
    'data.mix.weight': '> 0 and finite (STRICT refuses inf and nan); the weights are normalised to shares',
    'data.seed': 'sample order; independent of the layout',
    'parallel.dp': 'the grid; `dp·pp·cp·tp` ranks (rank order dp × pp × cp × tp, TP innermost)',
    'parallel.pp': 'the grid; `dp·pp·cp·tp` ranks (rank order dp × pp × cp × tp, TP innermost)',
    'parallel.tp': 'the grid; `dp·pp·cp·tp` ranks (rank order dp × pp × cp × tp, TP innermost)',
    'parallel.cp': (
        'context parallelism: each sequence split over `cp` ranks, two of `2·cp` chunks each (chunk i and 2cp−1−i, so '
        'causal work is even); `model.seq_len` must divide by `2·cp` (and `seq_len/cp` by tp under sequence '
        'parallelism); weights replicated over cp, gradients reduced (and ZeRO-sharded) over dp × cp; `gpt` and '
        '`llama`; not with `dp_sync: ps`. See [Long sequences](../guides/long-context.md)'
    ),
    'parallel.cp_impl': (
        'the attention kernel joining the cp shares: `ring` (K/V blocks passed round the ranks), `ulysses` '
        '(all-to-all to a head split: query heads per tp rank divisible by cp, K/V heads divisible by cp or dividing '
        "it), `allgather` (the whole K/V gathered, Llama 3's way); all three take `model.attention_mask: document`; "
        'set at cp=1: refused, as it would be ignored'
    ),
    'parallel.ep': (
        "expert parallelism: each MoE layer's experts split over groups of `ep` data x context-parallel ranks (no "
        'extra ranks; cp peers first); must divide `parallel.dp * parallel.cp` and `model.moe.experts`; not with 1-bit '
        'Adam or `dp_sync: ps` (see '
        '[Expert parallelism](../guides/moe.md))'
    ),
    'parallel.expert_tp': (
        "expert tensor parallelism: each routed expert's hidden split over the tp group (w1/w3 columns, w2 rows), so "
        'a rank holds `1 / (ep * tp)` of the routed weights; needs `tp > 1` and `ep > 1` and a hidden width tp '
        'divides (see [Expert parallelism](../guides/moe.md))'
    ),
    'parallel.zero': (
        '0: gradient buckets averaged during backward (DDP-style, also under TP and PP); 1: distributed optimizer '
        "(Megatron's: gradients reduce-scattered over dp, each rank steps its slice of every parameter, weights "
        'all-gathered; with any `tp`/`pp` and optimizer offload, see '
        '[ZeRO-1](../guides/memory.md#zero-1-the-distributed-optimizer)); 2: FSDP2 without reshard after forward; 3: '
        'FSDP2 with it'
    ),
    'parallel.pp_schedule': (
        '`gpipe`, `1f1b`, `interleaved_1f1b`, `interleaved_zero_bubble`, `zbv`, `dualpipev`; asynchronous (ours): '
        '`pipedream`, `pipedream_2bw` (see [Asynchronous '
        'pipelines](../guides/pipelines.md#asynchronous-pipelines-pipedream-and-pipedream-2bw)); another than `1f1b` '
        'at pp=1: refused, as there is no pipeline'
    ),
    'parallel.virtual_stages': 'Unset: 1, or 2 for the multi-stage schedules. pipeline stages per pp rank',
    'parallel.pp_vertical_sync': (
        '`pipedream` only: every stage runs a microbatch on the weight version the first stage ran it on (sent with '
        'the activation)'
    ),
    'parallel.pp_2bw_every': (
        'Unset: `train.microbatches`. `pipedream_2bw` only: microbatches per weight version (m); at least `pp`, '
        'dividing `train.microbatches`'
    ),
    'parallel.pp_flush_per_step': (
        '`pipedream`, `pipedream_2bw` only: drain the pipeline at every step end (by default its steady state carries '
        'into the next step)'
    ),
    'parallel.pp_split': (
        'layers per pipeline stage: `even` (`n_layers` must divide into pp × virtual stages), `auto` (profiled costs '
        "+ PipeDream's dynamic program, within `parallel.device_memory` when set), or a list of layer counts, one per "
        'stage in stage order (virtual stages included), each ≥ 1, summing to `n_layers`. See [Pipeline stage '
        'split](../guides/pipelines.md#pipeline-stage-split-even-auto-or-a-list)'
    ),
    'parallel.sequence_parallel': "shard norms' activations along the sequence under TP",
    'parallel.device': '`cpu`, `cuda`, or `auto` (GPU when the cluster has one)',
    'parallel.cpus_per_rank': 'CPUs reserved per rank actor',
    'parallel.dp_sync': (
        '`ps`: data parallelism through parameter-server shards (see [Parameter '
        'server](../guides/parameter-server.md)); `diloco`: each replica steps its own optimizer, an outer step '
        'every `diloco_inner_steps` (see [DiLoCo](../guides/resilience.md#diloco))'
    ),
    'parallel.bucket_mb': (
        'zero 0: a gradient bucket closes at a block boundary once it holds this many MiB, and is averaged as soon as '
        'backward produced it (overlapping the rest of backward); 0: one bucket after backward (no overlap). See '
        '[Gradient communication](../guides/gradient-communication.md)'
    ),
    'parallel.grad_compression': (
        "zero 0, dp > 1: `bf16`, `fp16` (PyTorch's comm hooks), `powersgd` (rank `powersgd_rank`, default 4, after "
        '`powersgd_warmup_steps` plain steps, default 10), `topk` (share `topk_ratio`, default 0.01); the last two '
        'keep the error for the next step, and also run at zero 1 (replacing its reduce-scatter; zero 1-3 take '
        '`grad_reduce_dtype: bf16` for a 16-bit reduction)'
    ),
    'parallel.powersgd_rank': "grad_compression powersgd: rank of the gradient matrices' factors",
    'parallel.powersgd_warmup_steps': (
        "grad_compression powersgd: steps of plain all-reduce before compressing (PyTorch's start_powerSGD_iter); 10 "
        'cut the worst loss gap over 200 steps from 7.9% to 2.2% '
        '([Gradient communication](../guides/gradient-communication.md))'
    ),
    'parallel.topk_ratio': 'grad_compression topk: share of entries sent',
    'parallel.fsdp_prefetch': (
        "`zero` 2/3 only: each block, once gathered, starts FSDP2's all-gathers of the next k blocks in forward and "
        'the k before it in backward (`set_modules_to_forward_prefetch`/`set_modules_to_backward_prefetch`): more '
        "overlap, up to k more whole blocks held; 0 keeps FSDP2's implicit order (one block ahead in backward). "
        'Parity checked on CPU; the speed-up is a GPU measurement'
    ),
    'parallel.device_memory': (
        "Unset: the GPU's own size; none on CPU. bytes per device for the fit check before start (`80GB`, `80GiB` or "
        'a number)'
    ),
    'optim.name': (
        "`adamw`, `adam`, `sgd` (`momentum`), `adafactor` (PyTorch's), `sm3` (ours, `momentum`), `paged_adamw` (AdamW "
        'with its state in the offload store), `onebit_adam` (1-bit Adam: AdamW for `warmup_steps`, then the variance '
        "frozen and the momentum sent as signs with error feedback; zero 0, tp 1), `muon` (PyTorch's Muon on the "
        "blocks' matrices, AdamW on the rest: see [Muon](../guides/memory.md#muon))"
    ),
    'optim.lr': (
        "a `--resume` trains at the job file's values (`--resume --set optim.lr=1e-4` lowers the rate from the saved "
        "schedule position on); the checkpoint brings the optimizer's moments and the schedule's position, not its "
        'settings'
    ),
    'optim.weight_decay': (
        "a `--resume` trains at the job file's values (`--resume --set optim.lr=1e-4` lowers the rate from the saved "
        "schedule position on); the checkpoint brings the optimizer's moments and the schedule's position, not its "
        'settings'
    ),
    'optim.weight_decay_exclude': (
        'which parameters `weight_decay` spares: `1d`, those of fewer than 2 dimensions (norm weights, biases; '
        'matrices and embeddings decay), as Megatron-Core, nanoGPT and the Hugging Face Trainer do; `none`, every '
        "parameter (torchtitan's, and raymesh's before this field). The default is `1d` because decaying a norm's "
        'gain or a bias pulls it towards 0 rather than regularising anything, and because `weight_decay` defaults to '
        '0 no default run changes (a job file that sets `weight_decay` now spares its 1-D parameters: set `none` to '
        'keep the old update). Applied alike by every optimizer (the torch ones under each `implementation`, `sm3`, '
        "`onebit_adam`, the offloaded Adam), ZeRO-1's slices and FSDP2's shards (each keeps its parameter's group), "
        'LoRA, the single-process reference and the parameter-server shards (by the layout the ranks register). A '
        'checkpoint saved with one group (before the field, or with `none`) resumes into two, and one saved with two '
        "into one: the job's decay wins per parameter. Set with `weight_decay: 0`: refused (nothing decays)"
    ),
    'optim.betas': (
        "a `--resume` trains at the job file's values (`--resume --set optim.lr=1e-4` lowers the rate from the saved "
        "schedule position on); the checkpoint brings the optimizer's moments and the schedule's position, not its "
        'settings'
    ),
    'optim.momentum': "sgd's momentum (0: plain SGD); refused with an optimizer that does not read it",
    'optim.grad_clip': 'global-norm clipping across all stages and shards; 0 disables',
    'optim.warmup_steps': (
        'linear warmup, then `constant`, `cosine` or `linear` (decay from the end of warm-up to `min_lr_ratio` × `lr` '
        'at `train.steps`), or `wsd` (warmup-stable-decay, as MiniCPM and DeepSeek train: the rate held, then decayed '
        'to `min_lr_ratio` over the last steps). The factor is computed from the step count, which a checkpoint '
        'saves: `--resume` continues the schedule exactly, and a resume with a longer `train.steps` decays to the new '
        "end from the saved step (cosine, linear and wsd alike: wsd's window moves to the new end)"
    ),
    'optim.schedule': (
        'linear warmup, then `constant`, `cosine` or `linear` (decay from the end of warm-up to `min_lr_ratio` × `lr` '
        'at `train.steps`), or `wsd` (warmup-stable-decay, as MiniCPM and DeepSeek train: the rate held, then decayed '
        'to `min_lr_ratio` over the last steps). The factor is computed from the step count, which a checkpoint '
        'saves: `--resume` continues the schedule exactly, and a resume with a longer `train.steps` decays to the new '
        "end from the saved step (cosine, linear and wsd alike: wsd's window moves to the new end)"
    ),
    'optim.min_lr_ratio': (
        'linear warmup, then `constant`, `cosine` or `linear` (decay from the end of warm-up to `min_lr_ratio` × `lr` '
        'at `train.steps`), or `wsd` (warmup-stable-decay, as MiniCPM and DeepSeek train: the rate held, then decayed '
        'to `min_lr_ratio` over the last steps). The factor is computed from the step count, which a checkpoint '
        'saves: `--resume` continues the schedule exactly, and a resume with a longer `train.steps` decays to the new '
        "end from the saved step (cosine, linear and wsd alike: wsd's window moves to the new end)"
    ),
    'optim.decay_steps': (
        '`wsd` only (else refused): its decay covers the last `decay_steps` steps, or `decay_ratio` × `train.steps` '
        "(set one: a `decay_ratio` other than 0.1 beside `decay_steps` is refused; to switch a job file's ratio to "
        'steps from the command line, `--set optim.decay_steps=N optim.decay_ratio=0.1`), in the shape `linear`, '
        '`cosine` or `1-sqrt` (Hägele et al. 2024). A window longer than the steps after warm-up is cut to them, not '
        'refused, so `--set train.steps=3` smoke-runs a long job file'
    ),
    'optim.decay_ratio': (
        '`wsd` only (else refused): its decay covers the last `decay_steps` steps, or `decay_ratio` × `train.steps` '
        "(set one: a `decay_ratio` other than 0.1 beside `decay_steps` is refused; to switch a job file's ratio to "
        'steps from the command line, `--set optim.decay_steps=N optim.decay_ratio=0.1`), in the shape `linear`, '
        '`cosine` or `1-sqrt` (Hägele et al. 2024). A window longer than the steps after warm-up is cut to them, not '
        'refused, so `--set train.steps=3` smoke-runs a long job file'
    ),
    'optim.decay_shape': (
        '`wsd` only (else refused): its decay covers the last `decay_steps` steps, or `decay_ratio` × `train.steps` '
        "(set one: a `decay_ratio` other than 0.1 beside `decay_steps` is refused; to switch a job file's ratio to "
        'steps from the command line, `--set optim.decay_steps=N optim.decay_ratio=0.1`), in the shape `linear`, '
        '`cosine` or `1-sqrt` (Hägele et al. 2024). A window longer than the steps after warm-up is cut to them, not '
        'refused, so `--set train.steps=3` smoke-runs a long job file'
    ),
    'optim.implementation': (
        "PyTorch's kernels for the update: `auto` (fused for adam/adamw/sgd when the parameters are on CUDA, else "
        "PyTorch's default: the loop on CPU), `fused`, `foreach` or `for_loop` (same update, different kernels). "
        'Refused for the optimizers that offer no choice (`sm3`, `paged_adamw`, `onebit_adam`, Adam with '
        '`memory.offload.optimizer`; `adafactor` has no `fused`), under `dp_sync: ps`, and `fused`/`foreach` where a '
        "rank's parameters mix DTensors and plain tensors (`tp` > 1 without `sequence_parallel`, or with `model.moe`: "
        "PyTorch's multi-tensor kernels refuse the mix; `auto` steps those with the loop)"
    ),
    'optim.muon_momentum': (
        "`muon` only (else refused): the momentum of each matrix's one buffer, Nesterov's look-ahead, the "
        "Newton-Schulz iterations (`torch.optim.Muon`'s `momentum`, `nesterov`, `ns_steps`)"
    ),
    'optim.muon_nesterov': (
        "`muon` only (else refused): the momentum of each matrix's one buffer, Nesterov's look-ahead, the "
        "Newton-Schulz iterations (`torch.optim.Muon`'s `momentum`, `nesterov`, `ns_steps`)"
    ),
    'optim.muon_ns_steps': (
        "`muon` only (else refused): the momentum of each matrix's one buffer, Nesterov's look-ahead, the "
        "Newton-Schulz iterations (`torch.optim.Muon`'s `momentum`, `nesterov`, `ns_steps`)"
    ),
    'precision.dtype': (
        "`fp32`, `bf16` (FSDP2's mixed-precision policy or autocast: `precision.policy`), `fp16` (autocast + dynamic "
        'loss scaling; a step whose gradients overflow is skipped, the scale halves, and the LR schedule still moves '
        "on a step, as in PyTorch's AMP recipe, so it follows the step count)"
    ),
    'precision.initial_loss_scale': 'fp16 only (set with another dtype: refused, as it would be ignored)',
    'precision.policy': (
        "how bf16 computes: `fsdp` (FSDP2's `MixedPrecisionPolicy`: bf16 parameters, compute and all-gathers over "
        "fp32 shards that are the optimizer's masters; needs `parallel.zero` 2 or 3 with `dp_sync: allreduce`), "
        '`autocast` (per-op casts over fp32 weights; every layout); `auto`: `fsdp` where it applies on a GPU, '
        '`autocast` elsewhere (see [Mixed precision](../guides/mixed-precision.md))'
    ),
    'precision.reduce_dtype': (
        "gradient reduction and accumulation dtype under the `fsdp` policy (`bf16` halves the reduce-scatter's "
        'bytes); refused where that policy does not run'
    ),
    'memory.recompute': (
        "unset: `none` on a CPU; on a GPU the first of `none`, `selective`, `full` whose planned peak fits the device "
        "(`event=defaults_picked` says which and why; [low precision and fast defaults](../guides/low-precision.md)). "
        "`none`, `selective` (attention core), `full` (whole blocks), `sqrt` (Chen et al. 2016's segment "
        'checkpointing: round(√n_layers) segments of blocks, only each segment\'s input stored, the segment recomputed '
        'whole in backward; the memory model follows it; not with `recompute_every` or `train.compile`)'
    ),
    'memory.recompute_every': (
        'apply `memory.recompute` to every k-th block only (global layer index a multiple of k); the memory model '
        'follows it'
    ),
    'memory.offload.optimizer': (
        'Adam moments (+ fp32 masters of device parameters) live in the offload store; the step runs on the host'
    ),
    'memory.offload.params': (
        'ZeRO-3 parameter shards live in the store between uses (needs `zero: 3` and `optimizer: true` or '
        '`paged_adamw`; works with `tp` and `pp`)'
    ),
    'memory.offload.activations': 'saved activations go to the store in forward and come back for backward',
    'memory.offload.tier': (
        '`cpu` (pinned host memory on a GPU) or `nvme` (memory-mapped files under `path`, required)'
    ),
    'memory.offload.path': (
        '`cpu` (pinned host memory on a GPU) or `nvme` (memory-mapped files under `path`, required)'
    ),
    'memory.offload.prefetch': 'items the store reads ahead of use',
    'memory.activation_compression': (
        '`bf16` or `fp8` (e4m3, per-tensor scale): saved activations kept lossy for backward'
    ),
    'memory.measure': (
        'each rank measures its parameter/gradient/optimizer/activation bytes every step, and their in-step peak '
        'together (`step_peak`); summary `memory`'
    ),
    'memory.headroom': (
        "`raymesh plan` refuses layouts whose predicted in-step peak passes (1 - headroom) of the GPU's memory"
    ),
    'plan.gpu': (
        'GPU type `raymesh plan --nodes` prices layouts with (`A100`, `H100`, `H200`: peak, memory, bandwidths)'
    ),
    'plan.efficiency': 'share of peak FLOP/s the compute term assumes',
    'plan.intra_node_gbps': (
        'Unset: per GPU type. GB/s per GPU and direction: NVLink (A100 300, H100/H200 450), InfiniBand share (A100 '
        '25, H100/H200 50)'
    ),
    'plan.inter_node_gbps': (
        'Unset: per GPU type. GB/s per GPU and direction: NVLink (A100 300, H100/H200 450), InfiniBand share (A100 '
        '25, H100/H200 50)'
    ),
    'train.steps': 'total optimizer steps (a resumed run continues to this)',
    'train.global_batch_size': 'sequences per step over all data ranks',
    'train.microbatches': 'per data rank: gradient accumulation, or pipeline microbatches when pp > 1',
    'train.seed': 'model initialisation (identical on every layout)',
    'train.log_every': (
        'figures of every N-th step (and the last, and each that evaluated) go to the trackers and, without a '
        'progress bar, to an `event=step` log line; `steps.jsonl` keeps every step'
    ),
    'train.compile': (
        'unset: off on a CPU, on on a GPU wherever the job\'s other settings allow it (`event=defaults_picked`). '
        'every transformer block compiled in place with `torch.compile(fullgraph=True)` (inductor; parameter names, '
        'checkpoints and HF export unchanged); the first step pays for compiling one block (the rest reuse its graph: '
        '~15 s on a 2-core CPU), and recompute runs through `torch.utils.checkpoint` inside the compiled block. Tried '
        'on CPU against the single-process reference (3 steps, 1e-4) with ZeRO-0/1/2/3, tp (with and without SP), pp '
        '1F1B/interleaved, full and selective recompute, activation offload, LoRA and QLoRA, and ran with bf16/fp16, '
        'activation compression and PipeDream; the tests keep two of these layouts. Context parallelism (every '
        '`cp_impl`), document masks and sliding windows compile too: their attention is a custom operator the block '
        'traces around; a block holding an MoE layer compiles its other parts and runs the MoE layer eagerly. '
        'Refused (each fails at the first step on torch 2.13): the zero-bubble schedules '
        '(`interleaved_zero_bubble`, `zbv`, `dualpipev`), `memory.recompute` with `tp` > 1, and `memory.measure` '
        'with recompute'
    ),
    'train.loss_chunks': (
        'the head and float32 cross entropy per chunk of each sequence (N chunks, uneven when N does not divide the '
        "tokens), each under `torch.utils.checkpoint`: a chunk's [tokens/N, vocab] logits are freed after its forward "
        "and recomputed in backward, so the whole logits (16-19 GiB for 8×4096 tokens at Llama 3's or Qwen's "
        'vocabulary) never exist; the loss is the same sum over the same count (1e-6 in fp32; the parity tests hold '
        'at 1e-4). 1: the whole logits as before. Works with dp, ZeRO 0-3 (FSDP2 gathers the sharded head around the '
        'chunks), tp with or without SP (the logits gathered over the vocabulary a chunk at a time), pp (the last '
        'stage, synchronous schedules), tied embeddings, LoRA/QLoRA, MoE, a loss mask and `eval:`; generation and '
        'exports keep full logits. Costs a second head forward in backward and one head-weight gradient beside their '
        "sum (see [Benchmarks](../benchmarks.md#loss-chunks)). Refused: more chunks than a rank's tokens a sequence "
        '(`seq_len / cp`; the layout picker leaves out the cp degrees that would be, rather than pricing and offering '
        "them) and PipeDream's schedules (their stashed weight versions would not reach the head). `raymesh plan` "
        'advises a count where the logits dominate'
    ),
    'train.objective': (
        '`lm`: next-token cross entropy; `dpo`: Direct Preference Optimization on `prepare-data --format preference` '
        'pairs, the reference the model with its LoRA adapters disabled (needs `model.lora`; dp, ZeRO 0-3 and tp '
        'only; see [DPO](../guides/fine-tuning.md#dpo-direct-preference-optimization))'
    ),
    'train.dpo_beta': (
        "DPO's β: the scale of the rewards β·(π − ref), how far the policy may move from the reference; at most 1000 "
        '(the rewards stay finite in float32); refused without `train.objective: dpo`'
    ),
    'eval.every': (
        'score the held-out loss after every N-th step and after the last (with gradients off, on the same sequences '
        "each time); 0: never. Needs `eval.path`; refused with asp/ssp parameter servers (each replica's weights are "
        'its own) and with an asynchronous pipeline that is not drained at every step end '
        '(`parallel.pp_flush_per_step: true`). See [Held-out evaluation](../guides/evaluation.md)'
    ),
    'eval.path': (
        'a prepared directory the model does not train on (`raymesh prepare-data --heldout` writes `DATA/heldout`; or '
        "your validation text prepared with the training data's `--tokenizer`: another tokenizer's ids are refused "
        'before start); a local path or an object-store URL'
    ),
    'eval.batches': (
        'batches of `train.global_batch_size` sequences per evaluation: the first `eval.batches × global_batch_size` '
        'windows of `eval.path` in its order for `data.seed`; refused before start when the directory holds fewer '
        '(the message gives the most it holds)'
    ),
    'checkpoint.every': 'save every N steps and at the end; 0 = never',
    'checkpoint.dir': (
        'Unset: `<run_dir>/checkpoints`. a fresh run (no `--resume`) into a directory holding any `step-*` folder '
        '(sealed, unsealed or set aside) is refused before anything starts, naming them; a `--resume` that finds '
        'nothing to resume from (the job never saved, or every checkpoint fails its checksums) is refused too, '
        "instead of starting over; each save records the job fields its tensors are read by (`job.json`: the model's "
        'shape, `model.moe` experts, `model.lora` rank, alpha and targets, `optim.name`, `precision.dtype`, the '
        'padded vocabulary), and a `--resume`, `export-hf`, `export-merged` or `generate` whose job file reads them '
        'otherwise is refused before anything starts, naming the field and the saved value (layout changes are not: '
        'DCP reshards them; `adam`/`adamw`, and fp32/bf16 over an fp16 save, read the same state); a checkpoint saved '
        "before `job.json` existed is checked on the ranks instead, which refuse one holding model weights the job's "
        'model lacks, such as layers past `model.n_layers`, naming a few of them and the saved layer count); may be '
        'an object-store URL (`s3://BUCKET/PATH`, `gs://...`, `file:///abs/path`; see [Object '
        'storage](../guides/object-storage.md))'
    ),
    'checkpoint.async': (
        'DCP async save on its own process group; sealed as soon as every rank has it durable. A save that fails '
        "(disk full), in the call or in the background, is logged (`checkpoint_failed`, with the rank's error: its "
        "cause and the folder) and training goes on; the run's last step is saved again synchronously if its async "
        "save failed, and if that fails too the run ends `failed` (exit 1; the summary's `checkpoint_failure` names "
        'the steps not kept)'
    ),
    'checkpoint.keep': 'complete checkpoints kept (never one newer than the step just saved)',
    'checkpoint.keep_best': (
        'also keep the checkpoint with the lowest held-out loss, however old (each checkpoint of a step that '
        'evaluated carries its loss in `eval.json`, under its checksums); needs `eval.every` dividing '
        "`checkpoint.every`. The summary's `best_checkpoint` and `--checkpoint best` (`generate`, `export-hf`, "
        '`export-merged`) name it. See [Held-out evaluation](../guides/evaluation.md)'
    ),
    'checkpoint.memory_every': (
        'Unset: 1 or 10. in-memory snapshot (+ replica on a peer) every N steps; 0 = off; unset: every step where the '
        'data-parallel replicas mirror each other (zero 0, dp > 1, and dp > ep under expert parallelism: nothing is '
        'shipped), else 10. Not mirrors: ranks that keep state of their own (`grad_compression: powersgd` or `topk`, '
        '`optim.name: onebit_adam`: their error feedback; `pipedream`/`pipedream_2bw` with dp > 1: their microbatches '
        "in flight), whose replicas ship. Their host memory is reserved with each rank's placement and shown by "
        '`raymesh plan` ([Memory model and planner](../concepts/planner.md))'
    ),
    'checkpoint.permissions': (
        'who may read the checkpoints: `private` (folders 0700, files 0600), `group` (0750, 0640) or `umask` (as the '
        "process's umask leaves them). Each step folder gets the mode before the ranks write into it and every file "
        'in it before the seal; the checkpoint dir and run dir get it when raymesh makes them (one that exists keeps '
        "its mode). Local and shared file systems; a bucket's access is its own policy"
    ),
    'metrics.timeline': (
        "record every pipeline F/B/W chunk (without a pipeline: each microbatch's forward+backward, `FB`) and every "
        "gradient bucket's reduction (`allreduce`) to `timeline.jsonl`"
    ),
    'metrics.comm_bytes': (
        'count the bytes every collective sends, per mesh dimension, into each step record (`comm_bytes`), Prometheus '
        "(`raymesh_comm_bytes{dim}`) and the report; it watches every tensor op, which makes a tiny CPU model's step "
        'about three times slower (the test job at dp=2: 42 → 133 ms)'
    ),
    'metrics.port': 'Prometheus endpoint of the controller; 0 = any free port; unset = no endpoint',
    'metrics.host': (
        "interface the Prometheus endpoint binds; `0.0.0.0` (or the node's IP) for a Prometheus on another machine"
    ),
    'metrics.file_sd': 'Unset: `runs/prometheus_targets/<run_dir name>.json`. Prometheus file_sd target file',
    'metrics.peak_tflops_per_rank': (
        'Unset: by device (H100/H200 989, A100 312; CPU nominal 0.1). for the MFU estimate'
    ),
    'control.host': (
        "interface the control API binds (`raymesh status/stop/inject/scale`); `0.0.0.0` or the node's IP lets other "
        'machines call it (with the token; add TLS)'
    ),
    'control.port': 'control API port; 0 = any free port',
    'control.tls_cert': (
        'PEM certificate chain and key: the control API then speaks TLS only (clients trust the announced certificate '
        'or `RAYMESH_TLS_CA`)'
    ),
    'control.tls_key': (
        'PEM certificate chain and key: the control API then speaks TLS only (clients trust the announced certificate '
        'or `RAYMESH_TLS_CA`)'
    ),
    'control.allow_faults': (
        'Unset: on only when the job file has `faults:`. whether `raymesh inject` may inject faults into the running '
        'job'
    ),
    'fault_tolerance.collective_timeout_s': (
        'a collective waiting on a peer gives up after this (below the heartbeat timeout)'
    ),
    'fault_tolerance.heartbeat_timeout_s': (
        "the progress deadline of a window's first step, a save and an evaluating step (other steps: `hang_steps` "
        'typical steps, at least `hang_floor_s`, at most this), past which the stuck ranks count as hung; every other '
        'controller call waits at most 5× this'
    ),
    'fault_tolerance.hang_steps': (
        'the progress deadline of a typical step, in typical steps (the median of the last twenty); a rank that '
        "misses it hung, and every rank's Python stacks go to `<run_dir>/hangs/` before it is replaced "
        '([hangs and preemption](../guides/resilience.md))'
    ),
    'fault_tolerance.hang_floor_s': (
        "the least progress deadline of a typical step, in seconds, so a run of very short steps does not call a "
        "rank's pause (a collection, a page fault storm) a hang"
    ),
    'fault_tolerance.survivor_grace_s': (
        "the backstop (on gloo a failed rank's peers are freed at once: it leaves its group): after a rank failed, "
        'survivors still blocked in the failed step this long (or 2 steps, if longer) are restarted with it and '
        'restored from their replicas, instead of waiting out `collective_timeout_s`'
    ),
    'fault_tolerance.nan_retries': (
        'a NaN step is rolled back and run again this many times before `on_repeated_nan` applies'
    ),
    'fault_tolerance.on_repeated_nan': (
        "`skip_batch`: that step's batch is skipped (event `nan_batch_skipped`), and the next one too if the step is "
        'NaN on it again (recorded in `CHECKPOINT_DIR/skipped_batches.json` at once, so a `--resume` or a restarted '
        'controller skips them too, even from a checkpoint saved before); `stop`: the run fails naming the step'
    ),
    'fault_tolerance.max_restarts': (
        'rank restarts a job may spend within any `restart_window_s` (a NaN rollback counts as one; survivors '
        'restarted after the grace do not): a rate, so a long run that loses a rank a minute goes on while a crash '
        'loop (the same failure again at once) ends within minutes; also the most recovery attempts in a row that may '
        'fail before a step completes'
    ),
    'fault_tolerance.restart_window_s': (
        'the sliding window `max_restarts` counts in (20 per 10 min: up to two lost ranks a minute, sustained)'
    ),
    'fault_tolerance.recovery': (
        '`replace_failed`: new actors for the failed ranks only, state from memory, else disk; `restart_all`: every '
        'rank restarted from the last disk checkpoint (what Ray Train / torchrun do; a baseline); `keep_training`: '
        'the other data-parallel replicas go on stepping on their own data while the failed one is rebuilt, which '
        'then takes a live peer\'s state and rejoins at a step boundary (torchft\'s quorum semantics: the failed '
        'replica\'s share of those steps is skipped, so the run is not bit-identical to an uninterrupted one); '
        'plain data parallelism only (parallel.dp >= 2, zero 0, all-reduce, pp = tp = cp = ep = 1)'
    ),
    'fault_tolerance.warm_spares': (
        'CPU jobs: one rank process per node, started after the first step with torch already imported, takes a dead '
        "rank's place (the `replace` phase drops from seconds to ~0); `false` saves its host memory (~0.5 GB a node) "
        'and its start-up CPU, for jobs that are short or tight on host memory'
    ),
    'fault_tolerance.straggler_ratio': (
        "a rank whose step time is above ratio × the other ranks' median for this many consecutive steps is reported"
    ),
    'fault_tolerance.straggler_steps': (
        "a rank whose step time is above ratio × the other ranks' median for this many consecutive steps is reported"
    ),
    'fault_tolerance.placement_timeout_s': (
        "a dead rank's replacement not started by then (its node is gone): shrink dp instead"
    ),
    'fault_tolerance.min_dp': (
        'automatic shrink never goes below this many data-parallel replicas (the job fails, saying so)'
    ),
    'fault_tolerance.grow_check_s': 'while below the requested dp, look this often for room to grow back',
    'faults': (
        'injected faults: `{kind, rank, at_step, factor}`, or repeating: `{kind, rank (a number or random), every_s, '
        'jitter_s, seed}`'
    ),
    'faults.kind': (
        'what the injected fault does: `kill_rank`, `kill_node`, `hang_rank`, `slow_rank` (by `factor`), `nan_loss`, '
        '`corrupt_checkpoint`, `kill_ps_shard`, `raise_error`, `oom` (see [Fault '
        'tolerance](../guides/fault-tolerance.md))'
    ),
    'faults.rank': 'or `random`: drawn by seed (repeating faults only); checked by JobSpec._check_faults',
    'faults.shard': 'kill_ps_shard: which parameter-server shard dies',
    'faults.at_step': "a one-shot fault's step",
    'faults.factor': (
        'slow_rank: its steps take this many times as long (past MAX_SLOWDOWN the rank is hung: that is hang_rank)'
    ),
    'faults.every_s': 'instead of at_step: fire again every this many seconds',
    'faults.jitter_s': (
        'the n-th firing is due n * every_s after the first step, plus uniform(-jitter_s, jitter_s) (not cumulative)'
    ),
    'faults.seed': 'draws the gaps and random ranks of a repeating fault',
    'parameter_server.shards': (
        'how many parameter-server shard actors hold the parameters under `parallel.dp_sync: ps`'
    ),
    'parameter_server.consistency': (
        '`bsp` (every worker waits for every push), `ssp` (workers may run `staleness` clocks ahead of the slowest) '
        'or `asp` (never wait)'
    ),
    'parameter_server.staleness': 'ssp: a worker at clock c reads once the slowest reached c - staleness',
    'parameter_server.transport': (
        'how workers reach shards; gRPC is served either way (on loopback under "ray" on a one-node cluster)'
    ),
    'parameter_server.optimizer': 'None: optim.name',
    'parameter_server.chunk_elems': 'tensors are cut into chunks of at most this many elements',
    'parameter_server.virtual_nodes': 'points per shard on the consistent-hash ring',
    'parameter_server.snapshot_every': 'steps between shard snapshots to <run_dir>/ps; 0: off',
    'parameter_server.compression': (
        'lossy: pushes in bf16 (pulls too), or the top-k share of each gradient chunk with error feedback on the '
        'worker'
    ),
    'parameter_server.topk_ratio': "compression topk: share of each chunk's entries sent",
    'parameter_server.resize.at_step': 'the chunks move between step at_step - 1 and step at_step',
    'parameter_server.resize.shards': 'the shard count from `at_step` on',
    'parameter_server.tls_cert': (
        "PEM certificate chain and key (`dp_sync: ps` only): every shard's gRPC then speaks TLS only; the ranks trust "
        'that certificate, the outside reader the one `ps_routes.json` names or `RAYMESH_TLS_CA`. It must name the '
        "shards' addresses: `127.0.0.1` for `transport: ray` on a one-node cluster, else the node IPs Ray reports "
        '(see [Security](../guides/security.md))'
    ),
    'parameter_server.tls_key': (
        "PEM certificate chain and key (`dp_sync: ps` only): every shard's gRPC then speaks TLS only; the ranks trust "
        'that certificate, the outside reader the one `ps_routes.json` names or `RAYMESH_TLS_CA`. It must name the '
        "shards' addresses: `127.0.0.1` for `transport: ray` on a one-node cluster, else the node IPs Ray reports "
        '(see [Security](../guides/security.md))'
    ),
    'loggers': (
        'experiment trackers, a mapping (`tensorboard: {}`, `mlflow: {...}`) or a list of names (`[tensorboard, '
        'wandb]`, an item may be `{mlflow: {...}}`); see [Monitoring, reports and the '
        'client](../guides/monitoring.md). A tracker whose package is missing is refused before start, naming `pip '
        "install -e '.[trackers]'`"
    ),
    'loggers.tensorboard.dir': 'Unset: `RUN_DIR/tensorboard`. TensorBoard event files',
    'loggers.mlflow.tracking_uri': (
        'Unset: `sqlite:///RUN_DIR/mlflow.db`. a tracking URI (`http://host:5000`, `sqlite:///file.db`), or an SQLite '
        'file path (relative: under the run dir); MLflow 3 refuses its old plain-directory store'
    ),
    'loggers.mlflow.experiment': "Unset: the job's name. where the run goes in MLflow",
    'loggers.mlflow.run_name': "Unset: the run dir's name. where the run goes in MLflow",
    'loggers.wandb.project': 'the W&B run',
    'loggers.wandb.mode': (
        '`offline` writes `DIR/wandb/offline-run-*/run-*.wandb` with no network or account (`wandb sync` uploads it '
        'later); `online` needs `wandb login`'
    ),
    'loggers.wandb.dir': "Unset: the run dir. where W&B's `wandb/` folder goes",
    'loggers.wandb.entity': 'the W&B run',
    'loggers.wandb.run_name': "Unset: the run dir's name. the W&B run",
}
