"""``raymesh generate``: text from a job's checkpoint, in this process, without Ray.

The checkpoint (the job's newest by default, any layout: DCP reshards it to the whole model) is verified and
loaded the way the exports load it (``orchestrator.spec.lora.checkpoint_to_read``, ``workers.finetune.
rebuilt_model``); the prompt is encoded with the tokenizer the job's data was prepared with, after the
end-of-document id, since that is what precedes the start of every document the model trained on. Sampling
and the key/value cache are ``workers.model.generation``'s.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from orchestrator.errors import SpecError

REPLACEMENT = "\ufffd"  # what a character cut short decodes to, held back until its next bytes arrive


def add_generate_command(sub) -> None:
    """The ``generate`` subcommand and its options."""
    gen = sub.add_parser("generate", help="sample text from a job's checkpoint (any layout)")
    gen.add_argument("job", help="the job file the checkpoint was trained with")
    gen.add_argument("--checkpoint", help="one checkpoint step directory, or best: the one saved with the lowest "
                                          "held-out loss (default: the job's latest)")
    gen.add_argument("--prompt", default="", help="text to continue (default: empty, the start of a document)")
    gen.add_argument("--max-new-tokens", type=_whole(1), default=200, help="at most this many new tokens (200)")
    gen.add_argument("--temperature", type=_number(0.0, None), default=0.8,
                     help="softmax temperature; 0 is greedy, the most likely token every time (0.8)")
    gen.add_argument("--top-k", type=_whole(0), default=50, help="draw among the k most likely tokens; 0: all (50)")
    gen.add_argument("--top-p", type=_number(0.0, 1.0), default=1.0,
                     help="draw among the most likely tokens whose probabilities reach p; 1: all (1)")
    gen.add_argument("--samples", type=_whole(1), default=1, help="independent continuations of the prompt (1)")
    gen.add_argument("--seed", type=_whole(0), default=0, help="sampling seed: the same seed gives the same text")
    gen.add_argument("--no-stop", action="store_true",
                     help="go on past the end-of-document token instead of stopping there")
    gen.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when there is one)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (samples with text and ids, the checkpoint, tokens/s) instead")
    gen.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a job-file field")
    gen.set_defaults(func=run_generate)


def _whole(least: int):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {least}")
        return int(text)
    return parse


def _number(low: float, high: float | None):
    """A float of at least ``low`` (``high`` None: temperature, where 0 means greedy), or in (``low``, ``high``]
    (top-p: an empty nucleus would draw nothing)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and (value >= low if high is None else low < value <= high)):
            span = f">= {low:g} and finite" if high is None else f"in ({low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text!r} is not a number {span}")
        return value
    return parse


def run_generate(args: argparse.Namespace) -> int:
    """Load, encode, sample, print: text as it comes (one sample), each sample in turn, or one JSON object."""
    from orchestrator.spec import load_spec

    job = load_spec(args.job, args.set)
    started = time.perf_counter()
    tok = job_tokenizer(job)
    prompt = encode_prompt(tok, args.prompt, job.model.seq_len)
    checkpoint, model = load_for_generation(job, args.checkpoint, args.device)
    loaded = time.perf_counter()
    stream = _Stream(tok, sys.stdout, args.prompt) if args.samples == 1 and not args.json else None
    samples = sample(model, tok, prompt, args, job.model.seq_len, stream)
    seconds = time.perf_counter() - loaded
    _print_samples(args, tok, len(prompt), samples, str(checkpoint), seconds, stream)
    new = sum(len(ids) for ids in samples)
    print(f"raymesh: {new} tokens in {seconds:.2f} s ({new / seconds:.1f} tokens/s) from {checkpoint} "
          f"(loaded in {loaded - started:.1f} s)", file=sys.stderr)
    return 0


def _print_samples(args, tok, prompt_tokens: int, samples: list[list[int]], checkpoint: str, seconds: float,
                   stream) -> None:
    """The samples on stdout: the streamed one's last characters, each sample in turn, or one JSON object."""
    texts = [tok.decode(_without_stop(ids, tok.eos_id)) for ids in samples]
    if args.json:
        new = sum(len(ids) for ids in samples)
        print(json.dumps({"checkpoint": checkpoint, "prompt": args.prompt, "prompt_tokens": prompt_tokens,
                          "samples": [{"text": t, "ids": ids, "ended": bool(ids) and ids[-1] == tok.eos_id}
                                      for t, ids in zip(texts, samples, strict=True)],
                          "seconds": seconds, "tokens_per_s": new / seconds}))
    elif stream is None:
        for i, text in enumerate(texts):
            print(f"--- sample {i + 1} ---\n{args.prompt}{text}")
    else:
        stream.finish()


def load_for_generation(job, checkpoint: str | None, device: str):
    """The verified checkpoint's path and the whole model with its weights, on ``device``."""
    import torch

    from orchestrator.planning.stage_split import pin_split
    from orchestrator.spec.lora import checkpoint_to_read
    from workers.finetune import rebuilt_model

    path = checkpoint_to_read(job, checkpoint, "generate from")
    target = _device(device, torch)
    _, model = rebuilt_model(pin_split(job).worker_dict(), path)
    return path, model.to(target)


def job_tokenizer(job):
    """The tokenizer the training data was prepared with (its manifest says which; a `data.mix`'s sources share one,
    checked before the run, so the first one's), refused with the fix when the data has none."""
    from orchestrator.spec.runtime_checks import prepared_manifest
    from workers.data.tokenizer import TokenizerMismatch, recorded_tokenizer
    from workers.storage import location

    path, _ = job.data.sources()[0]
    field = job.data.field_of(path)
    manifest = prepared_manifest(field, path)
    try:
        return recorded_tokenizer(manifest.get("tokenizer") or {"kind": "bytes"}, location(path))
    except TokenizerMismatch as exc:
        raise SpecError(field, path, f"names a tokenizer that is not the one its data was prepared with: {exc}, so "
                        "the sampled ids would decode to other text", "put back the tokenizer.json the data was "
                        f"prepared with, or prepare the data again with this one (`raymesh prepare-data --tokenizer "
                        f"FILE --out {path}`) and train on it") from None
    except (LookupError, FileNotFoundError) as exc:
        raise SpecError(field, path, f"gives no tokenizer to turn text into ids and back ({exc})",
                        f"point {field} (--set {field}=DIR) at a directory `raymesh prepare-data` wrote with "
                        "the same tokenizer") from None


def _device(name: str, torch):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    here = device is not None and (device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()))
    if not here:
        raise SpecError("--device", name, "is not a device this machine has",
                        "pass cpu, or cuda / cuda:N on a machine with a GPU, or auto")
    return device


def encode_prompt(tok, prompt: str, window: int) -> list[int]:
    """The end-of-document id, then ``prompt``'s ids; refused when the model's window cannot take them and a new
    token."""
    ids = [tok.eos_id, *tok.encode(prompt.encode("utf-8")).tolist()]
    if len(ids) >= window:
        raise SpecError("--prompt", f"{prompt[:40]}... ({len(ids) - 1} tokens)",
                        f"does not fit model.seq_len={window} with the end-of-document token before it and room "
                        "for one new token", f"shorten the prompt to at most {window - 2} tokens")
    return ids


def sample(model, tok, prompt: list[int], args: argparse.Namespace, window: int, stream) -> list[list[int]]:
    """``args.samples`` continuations of ``prompt`` under the options in ``args``."""
    from workers.model.generation import Sampling, generate

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, vocab=tok.vocab_size,
                        stop=None if args.no_stop else tok.eos_id, seed=args.seed)
    on_token = None if stream is None else stream.add
    return generate(model, prompt, args.max_new_tokens, sampling, window=window, samples=args.samples,
                    on_token=on_token)


def _without_stop(ids: list[int], stop: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == stop else ids


class _Stream:
    """Prints one sample's text as its tokens arrive: the whole is decoded each time (a token need not be whole
    characters) and what is new printed, holding back a trailing character still cut short."""

    def __init__(self, tok, out, prompt: str) -> None:
        self.tok, self.out = tok, out
        self.ids: list[int] = []
        self.shown = ""
        out.write(prompt)

    def add(self, ids) -> None:
        if int(ids[0]) == self.tok.eos_id:
            return
        self.ids.append(int(ids[0]))
        self._show(self.tok.decode(self.ids).rstrip(REPLACEMENT))

    def finish(self) -> None:
        self._show(self.tok.decode(self.ids))
        self.out.write("\n")
        self.out.flush()

    def _show(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text
