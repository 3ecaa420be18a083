"""``model.preset``: Llama shapes by name, apart from the model code (``workers.model.llama``).

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
