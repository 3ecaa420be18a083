"""torchtitan on the GPU benchmark's job, through its own entry point, and the raymesh/torchtitan ratios.

torchtitan (PyPI ``torchtitan``; 0.2 and 0.3 are both driven, ``command``) trains the job's shape from
``benchmarks/torchtitan_job.py`` with a Hugging Face text dataset and tokenizer: both are made here, offline (a few
hundred thousand characters of random words as a local ``json`` dataset; a byte-level BPE ``tokenizer.json``
trained on them with ``tokenizers``), since the GPU machine reaches no hub. The token ids differ from raymesh's
run; a step's cost does not depend on them. It logs one line per step (``step: N loss: ... tps: N tflops: ...
mfu: N%``); the warm-up steps are dropped as on raymesh's side, and tokens/s and MFU are aggregated as total
tokens over total time (the harmonic mean of per-step figures: every step has the same tokens).

Known differences, reported rather than hidden: torchtitan counts FLOPs without the embedding, raymesh with it
(``mfu_same_formula`` recomputes torchtitan's MFU with raymesh's FLOPs per token and peak, so that MFU ratio
compares like with like). 0.2's Llama attends with SDPA under a causal mask as raymesh's does, but ties no
weights (its head is a matrix of its own: same FLOPs, more parameters); 0.3's ties them but attends with flex
attention under a block-causal mask (it refuses SDPA for language models). Each torchtitan release pins the
PyTorch nightly of its day: 0.2.2 (February 2026) is the one nearest torch 2.11 and trains on it; 0.3.0
(September 2026) needs a later torch (on 2.11 it fails at import, wanting ``DataParallelMeshDims`` from FSDP).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.torchtitan_job import JOB_ENV, float8_settings
from orchestrator.planning.flops import utilization

ROOT = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:.*?tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+%|N/A)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def skipped(reason: str) -> dict:
    """The torchtitan section when it did not run: every figure null, and why."""
    return {"version": None, "tokens_per_s": None, "mfu": None, "mfu_same_formula": None, "steps": [],
            "reason": reason}


def parse_steps(log: str) -> list[dict]:
    """torchtitan's per-step metric lines (colour codes stripped): step, tokens/s, TFLOP/s, MFU (a fraction)."""
    out = []
    for line in ANSI.sub("", log).splitlines():
        match = STEP_LINE.search(line)
        if match:
            step, tps, tflops, mfu = match.groups()
            out.append({"step": int(step), "tokens_per_s": float(tps.replace(",", "")),
                        "tflops": float(tflops.replace(",", "")),
                        "mfu": None if mfu == "N/A" else float(mfu.rstrip("%")) / 100})
    return out


def summarize(steps: list[dict], warmup: int) -> dict:
    """tokens/s and MFU over the steps after the warm-up: harmonic means (equal tokens per step)."""
    timed = [s for s in steps if s["step"] > warmup]
    if not timed:
        return {"tokens_per_s": None, "mfu": None}
    mfus = [s["mfu"] for s in timed]
    # statistics.harmonic_mean is 0 when a value is: torchtitan prints MFU to 0.01 %, so a small model's steps
    # read ``mfu: 0.00%`` (0.2.2 on torch 2.11 does)
    return {"tokens_per_s": statistics.harmonic_mean([s["tokens_per_s"] for s in timed]),
            "mfu": None if None in mfus else statistics.harmonic_mean(mfus)}


def with_ratios(raymesh: dict, titan: dict) -> dict:
    """The torchtitan section with its MFU by raymesh's formula (raymesh's FLOPs per token and peak) and the
    raymesh / torchtitan ratios: tokens/s, MFU as each reports it, MFU by the same formula."""
    if titan["tokens_per_s"] is None:
        return {**titan, "ratio": None}
    same = utilization(raymesh["model_flops_per_token"], titan["tokens_per_s"], raymesh["peak_flops"])
    ratio = {"tokens_per_s": raymesh["tokens_per_s"] / titan["tokens_per_s"],
             "mfu": raymesh["mfu"] / titan["mfu"] if titan["mfu"] else None, "mfu_same_formula": raymesh["mfu"] / same}
    return {**titan, "mfu_same_formula": same, "ratio": ratio}


def write_assets(folder: Path, tokens_needed: int, vocab_size: int) -> tuple[Path, Path]:
    """A local text dataset of random words and a byte-level BPE tokenizer trained on it, with no more ids than
    the model's vocabulary (the alphabet is the 27 characters the words use, merges fill the rest)."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 9))) for _ in range(2000)]
    data = folder / "torchtitan-data"
    data.mkdir(parents=True, exist_ok=True)
    docs, chars = [], 0
    while chars < 6 * tokens_needed:  # a BPE of 512 ids takes well under 6 characters a token
        doc = " ".join(rng.choice(words, size=512))
        docs.append(doc)
        chars += len(doc)
    (data / "train.json").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(512, vocab_size), special_tokens=[BOS, EOS])
    tokenizer.train_from_iterator(docs[:50], trainer)
    assets = folder / "torchtitan-tokenizer"
    assets.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS,
                                                              "add_bos_token": True, "add_eos_token": False}))
    return data, assets


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def command(version: str, folder: Path, job: dict) -> list[str]:
    """torchtitan's own entry point under torchrun, one process: on 0.3 our config function, on 0.2 a TOML job
    (written into ``folder``) that imports our module, which adds the job's shape as a flavour."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "-m", "torchtitan.train"]
    if tuple(int(x) for x in version.split(".")[:2]) >= (0, 3):
        return [*run, "--module", "benchmarks.torchtitan_job", "--config", "raymesh_job"]
    toml = folder / "raymesh_job.toml"
    toml.write_text(toml_job(job))
    return [*run, "--job.config_file", str(toml)]


def toml_job(job: dict) -> str:
    """torchtitan 0.2's job file for the job (every value a string, number or boolean: written by hand, as
    Python reads TOML but does not write it)."""
    sections = {
        "job": {"dump_folder": job["dump_folder"]},
        "model": {"name": "llama3", "flavor": "raymesh", "hf_assets_path": job["tokenizer_dir"]},
        "optimizer": {"name": "AdamW", "lr": 3e-4},
        "lr_scheduler": {"warmup_steps": 0},
        "training": {"local_batch_size": job["global_batch_size"], "seq_len": job["seq_len"],
                     "steps": job["steps"], "dataset": "c4_test", "dataset_path": job["dataset_dir"],
                     "mixed_precision_param": "bfloat16" if job["precision"] == "bf16" else "float32"},
        "activation_checkpoint": {"mode": job["recompute"]},
        "metrics": {"log_freq": 1},
        "checkpoint": {"enable": False},
        "validation": {"enable": False},
        "compile": {"enable": job.get("compile", False)},  # model and loss, as raymesh compiles both
        "experimental": {"custom_import": "benchmarks.torchtitan_job"},
    }
    if float8_settings(job):  # 0.2 names its converters in [model], each one's settings in its own section
        sections["model"]["converters"] = ["float8"]
        sections["float8"] = float8_settings(job)
    return "".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()) + "\n"
                   for name, values in sections.items())


def run_torchtitan(job: dict, device: str, warmup: int, steps: int, folder: Path, timeout_s: float) -> dict:
    """Train the job with torchtitan for ``warmup + steps`` steps; its figures over the timed ones."""
    if importlib.util.find_spec("torchtitan") is None:
        return skipped(f"torchtitan is not importable by {sys.executable} (pip install torchtitan: "
                       "carry its wheel and its needs, see README 'GPU')")
    if device != "cuda":
        return skipped("torchtitan trains on an accelerator only (it falls back to cuda with none)")
    from importlib.metadata import version

    tokens = (warmup + steps) * job["global_batch_size"] * (job["seq_len"] + 1)
    data, assets = write_assets(folder, tokens, job["vocab_size"])
    titan = {**job, "steps": warmup + steps, "dataset_dir": str(data), "tokenizer_dir": str(assets),
             "dump_folder": str(folder / "tt")}
    env = {**os.environ, JOB_ENV: json.dumps(titan),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = command(version("torchtitan"), folder, titan)
    try:
        proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return {**skipped(f"torchtitan ran past {timeout_s:.0f}s (--torchtitan-timeout-s)"),
                "version": version("torchtitan"), "log_tail": _text(exc.stdout)[-3000:] + _text(exc.stderr)[-3000:]}
    log = proc.stdout + proc.stderr
    per_step = parse_steps(log)
    figures = summarize(per_step, warmup)
    if proc.returncode != 0 or figures["tokens_per_s"] is None:
        return {**skipped(f"torchtitan exited {proc.returncode} with {len(per_step)} step lines"),
                "version": version("torchtitan"), "log_tail": log[-3000:]}
    return {"version": version("torchtitan"), **figures, "mfu_same_formula": None, "steps": per_step,
            "command": " ".join(cmd[2:]), "reason": None}
