"""``model.preset``: Llama, DeepSeek-V3 and gpt-oss shapes by name, apart from the model code.

Torch-free, so the job-file checks (``orchestrator.spec``) fill a preset in without importing torch.
"""

# published Llama shapes (the 8B/70B/405B ones are Llama 3.1's, for `raymesh plan`), and two small ones that
# train here or on one GPU. A job's own fields override the preset's.
_LLAMA3 = {"arch": "llama", "vocab_size": 128256, "n_kv_heads": 8, "rope_theta": 500000.0, "seq_len": 8192,
           "norm_eps": 1e-5, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}}
PRESETS: dict[str, dict] = {
    "llama-150m": {"arch": "llama", "vocab_size": 32000, "d_model": 768, "n_layers": 16, "n_heads": 12,
                   "n_kv_heads": 4, "d_ff": 2048, "seq_len": 1024, "rope_theta": 10000.0},
    "llama-1b": {**_LLAMA3, "d_model": 2048, "n_layers": 16, "n_heads": 32, "d_ff": 8192, "seq_len": 2048,
                 "tie_embeddings": True, "rope_scaling": {**_LLAMA3["rope_scaling"], "factor": 32.0}},
    "llama3-8b": {**_LLAMA3, "d_model": 4096, "n_layers": 32, "n_heads": 32, "multiple_of": 1024,
                  "ffn_dim_multiplier": 1.3},
    "llama3-70b": {**_LLAMA3, "d_model": 8192, "n_layers": 80, "n_heads": 64, "multiple_of": 4096,
                   "ffn_dim_multiplier": 1.3},
    "llama3-405b": {**_LLAMA3, "d_model": 16384, "n_layers": 126, "n_heads": 128, "multiple_of": 4096,
                    "ffn_dim_multiplier": 1.2},
}

# DeepSeek-V3 671B (DeepSeek-AI 2024, its config.json): 61 layers, the first 3 dense, 256 routed experts (8 a token
# from 4 of 8 groups) and 1 shared, 2,048 wide, MLA with q/kv ranks 1,536/512; 671B parameters, 37B active. The MTP
# module (another 14B) is not part of it (raymesh builds none).
PRESETS["deepseek-v3-671b"] = {
    "arch": "deepseek_v3", "vocab_size": 129280, "d_model": 7168, "n_layers": 61, "n_heads": 128, "d_ff": 18432,
    "seq_len": 4096, "norm_eps": 1e-6, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "dense_layers": 3,
    "moe": {"experts": 256, "top_k": 8, "router": "sigmoid", "groups": 8, "top_groups": 4, "gate_scale": 2.5,
            "shared_experts": 1, "d_expert": 2048, "bias_balancing": True, "aux_loss_weight": 0.0001},
}

# gpt-oss (OpenAI 2025, its config.json): 24 / 36 layers alternating a 128-token window and full attention, 64 query
# heads over 8 K/V heads of 64, sinks, 32 / 128 experts (4 a token) 2,880 wide with biases, YaRN rotary x32 over 4,096;
# 20.9B / 116.8B parameters (3.6B / 5.1B active), as the model card gives them
_GPT_OSS = {"arch": "gpt_oss", "vocab_size": 201088, "d_model": 2880, "n_heads": 64, "n_kv_heads": 8, "head_dim": 64,
            "d_ff": 2880, "seq_len": 4096, "norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128,
            "rope_yarn": {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                          "truncate": False}}
PRESETS["gpt-oss-20b"] = {**_GPT_OSS, "n_layers": 24, "moe": {"experts": 32, "top_k": 4, "d_expert": 2880}}
PRESETS["gpt-oss-120b"] = {**_GPT_OSS, "n_layers": 36, "moe": {"experts": 128, "top_k": 4, "d_expert": 2880}}
