"""``raymesh`` command line: prepare-data, plan, run, attach, export-merged, export-hf, generate, report, schema."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orchestrator.cli.default_corpus import DEFAULT_MAX_TOKENS
from orchestrator.cli.generate import add_generate_command
from orchestrator.cli.jobs import add_client_commands
from orchestrator.errors import SpecError

MANIFEST = "manifest.json"  # prepare-data's index of the shards (workers.data.prepare)
CHECKPOINT_HELP = ("one checkpoint step directory, or best: the one saved with the lowest held-out loss (default: the "
                   "job's latest)")
HELDOUT_DIR = "heldout"  # prepare-data --heldout's folder (workers.data.prepare.HELDOUT_DIR)


def _prepare_data(args: argparse.Namespace) -> int:
    from orchestrator.spec import check_writable_dir
    from workers.data.prepare import default_sources, prepare_data, unreadable_message
    from workers.storage import is_url, staged_output

    if not is_url(args.out):  # else mkdir's bare "[Errno 17] File exists" names neither --out nor the fix
        check_writable_dir("--out", Path(args.out))
    sources = args.source or default_sources()
    last = (f"{HELDOUT_DIR}/{MANIFEST}", MANIFEST)
    with staged_output(args.out, last=last) as out:  # a URL: written here, then copied up, manifests last
        manifest = prepare_data(sources, out, shard_tokens=args.shard_tokens, max_tokens=args.max_tokens,
                                tokenizer=args.tokenizer, heldout=args.heldout, format=args.format,
                                seq_len=args.seq_len)
        if is_url(args.out):
            manifest = _manifest_at_url(out, args.out, manifest)
    if is_url(args.out):
        _remove_stale_shards(args.out, manifest)
    tok = manifest["tokenizer"]
    print(f"wrote {manifest['total_tokens']:,} tokens in {len(manifest['shards'])} shard(s) to {args.out}; "
          f"tokenizer {tok['kind']}{' ' + tok['path'] if tok['path'] else ''}, vocab {tok['vocab_size']} "
          f"(set model.vocab_size to at least that)")
    if manifest["total_tokens"] >= args.max_tokens:  # else a corpus past the default limit is cut without a word
        print(f"stopped at --max-tokens {args.max_tokens:,}: the sources may hold more, which was not prepared; "
              "raise --max-tokens to prepare it")
    if "unreadable" in manifest:  # else the user trains on less than the sources hold without a word
        print(f"warning: {unreadable_message(manifest['unreadable'])}", file=sys.stderr)
    if manifest.get("loss_mask"):
        print("the data carries a loss mask: only completion tokens are targets")
    if "heldout" in manifest:
        out = args.out.rstrip("/")
        print(f"held out {manifest['heldout']['tokens']:,} tokens of {args.heldout:.3g} of the documents in "
              f"{out}/{HELDOUT_DIR} (set eval.path to it)")
    return 0


def _manifest_at_url(staged: Path, url: str, manifest: dict) -> dict:
    """The staged manifests (the held-out one too) rewritten to name the trained tokenizer's file at ``url``, where
    it is copied (the staging directory is temporary)."""
    tok = manifest["tokenizer"]
    if not (tok.get("path") and Path(tok["path"]).parent == staged):
        return manifest
    named = {**tok, "path": f"{url.rstrip('/')}/{Path(tok['path']).name}"}
    for folder in (staged / HELDOUT_DIR, staged):
        if (folder / MANIFEST).is_file():
            written = {**json.loads((folder / MANIFEST).read_text()), "tokenizer": named}
            (folder / MANIFEST).write_text(json.dumps(written, indent=2))
    return {**manifest, "tokenizer": named}


def _remove_stale_shards(url: str, manifest: dict) -> None:
    """Shards a previous, larger prepare left at ``url`` and in its held-out folder (as `prepare_data` does in a
    local directory)."""
    from workers.storage import location

    root = location(url)
    folders = {root: manifest}
    held = root / HELDOUT_DIR / MANIFEST
    if "heldout" in manifest:
        folders[root / HELDOUT_DIR] = json.loads(held.read_text())
    for folder, listed in folders.items():
        keep = {shard["file"] for shard in listed["shards"]}
        for stale in folder.glob("shard-*.parquet"):
            if stale.name not in keep:
                stale.unlink()


def _plan(args: argparse.Namespace) -> int:
    from orchestrator.planning.estimate import render
    from orchestrator.planning.memory_report import fit_problems, loss_chunks_advice
    from orchestrator.planning.snapshot_memory import describe
    from orchestrator.planning.stage_replicas import replication_advice
    from orchestrator.spec import check_before_start, load_spec

    spec = load_spec(args.job, args.set)
    check_before_start(spec, data_required=False)  # what `run` would refuse before its actors start
    if args.nodes is None and args.gpus_per_node is None and args.gpu_mem is None and args.gpu is None:
        print(render(spec))
        print(describe(spec))
        for problem in fit_problems(spec):
            print(f"does not fit: {problem}")
        _print_advice(loss_chunks_advice(spec))
        _print_advice(replication_advice(spec))
        _print_noise_scale(spec, args.noise_scale)
        return 0
    from orchestrator.planning.layout_picker import explain, overrides, pick_layout
    from orchestrator.planning.layout_search import Shape

    gpu_mem = _gpu_mem(args.gpu_mem, spec)
    nodes, per_node = args.nodes or 1, args.gpus_per_node or 8
    choice = pick_layout(spec, nodes, per_node, gpu_mem, args.gpu)
    p = choice.spec.parallel
    cp = f" cp={p.cp}" if p.grid.cp_enabled else ""
    cp += f" dp_shard={p.dp_shard}" if p.grid.hybrid else ""
    cp += f" ep={p.ep}" if p.ep > 1 else ""
    schedule = f" schedule={p.pp_schedule} pp_split={list(choice.spec.stage_split)}" if p.pp > 1 else ""
    print(f"picked dp={p.dp} pp={p.pp}{cp} tp={p.tp} zero={p.zero} microbatches={choice.spec.train.microbatches} "
          f"recompute={choice.spec.memory.recompute}{schedule} for {nodes} node(s) x {per_node} "
          f"{args.gpu or spec.plan.gpu}(s): {choice.reason}")
    for line in [*choice.tried[:5], *explain(choice)]:
        print(f"  {line}")
    print(render(choice.spec, one_per_stage=True))
    print(describe(choice.spec))
    _print_advice(loss_chunks_advice(choice.spec))
    sets = " ".join(f"--set {o}" for o in overrides(choice.candidate, Shape.of(spec)))
    print(f"run it: raymesh run {args.job} {sets}")
    return 0


def _print_noise_scale(spec, batches: int | None) -> None:
    """``--noise-scale N``: the gradient noise scale measured on N global batches, against the job's batch size."""
    if batches:
        from orchestrator.planning.noise_scale import measure

        _print_advice(measure(spec, batches).advice(spec.train.global_batch_size))


def _print_advice(line: str | None) -> None:
    if line:
        print(f"advice: {line}")


def _gpu_mem(text: str | None, spec) -> int | None:
    """``--gpu-mem``, else ``parallel.device_memory``, else None (the GPU type's own, ``plan.gpu``)."""
    from orchestrator.units import parse_bytes

    if text is None:
        return spec.parallel.device_memory_bytes
    try:
        return parse_bytes(text)
    except ValueError:
        raise SpecError("--gpu-mem", text, "is not a size", "write e.g. --gpu-mem 80GB, 80GiB or 85899345920",
                        where="raymesh plan") from None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def _run(args: argparse.Namespace) -> int:
    from orchestrator.cli.follow import run

    return run(args)


def _attach(args: argparse.Namespace) -> int:
    from orchestrator.cli.follow import attach

    return attach(args)


def _export_merged(args: argparse.Namespace) -> int:
    from orchestrator.planning.stage_split import pin_split
    from orchestrator.spec import load_spec
    from orchestrator.spec.lora import export_merged_weights

    out = export_merged_weights(pin_split(load_spec(args.job, args.set)), args.checkpoint, args.out, args.format)
    print(f"merged weights (W + alpha/rank * B A): {out}")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from orchestrator.planning.stage_split import pin_split
    from orchestrator.spec import load_spec
    from orchestrator.spec.lora import export_hf_weights

    out = export_hf_weights(pin_split(load_spec(args.job, args.set)), args.checkpoint, args.out)
    print(f"Hugging Face checkpoint (config.json + model.safetensors): {out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from orchestrator.observability.report import mix_text, write_report

    report = write_report(args.run_dir, args.out, args.step)
    if report["data_mix"]:
        step, mix = report["data_mix"]
        print(f"data mix through step {step}: {mix_text(mix)}")
    bubble = report["bubble"]
    if bubble["measured"] is not None:
        order = "" if bubble["ordered"] is None else f", its order at ideal costs {bubble['ordered']:.3f}"
        print(f"pipeline bubble at step {bubble['step']}: measured {bubble['measured']:.3f}{order}, "
              f"theory (p-1)/(v*m+p-1) {bubble['theoretical']:.3f} ({bubble['schedule']})")
    print(f"report: {report['html']}")
    return 0


def _schema(args: argparse.Namespace) -> int:
    """Print the job file's JSON Schema: what editors (the YAML language server) check and complete job files by."""
    from orchestrator.spec.reference import schema_text

    sys.stdout.write(schema_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raymesh", description="Ray-hosted 3-D parallel transformer training")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare-data", help="tokenize text files into Parquet token shards")
    prep.add_argument("--source", action="append", help="file or directory (repeatable); default: Python's stdlib")
    prep.add_argument("--out", required=True,
                      help="output directory or object-store URL, e.g. s3://BUCKET/data (becomes data.path)")
    prep.add_argument("--shard-tokens", type=int, default=4_000_000, metavar="N",
                      help="tokens per Parquet shard file (default 4,000,000)")
    prep.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                      help=f"stop after this many tokens, separators included (default {DEFAULT_MAX_TOKENS:,}); "
                           "the rest of the sources is not prepared")
    prep.add_argument("--tokenizer", default="bytes",
                      help="bytes (vocab 256, default), a tokenizer.json path, or bpe:SIZE to train a byte-level "
                           "BPE of SIZE ids on the sources (saved as OUT/tokenizer.json)")
    prep.add_argument("--heldout", type=float, default=0.0, metavar="FRACTION",
                      help="keep this share of the documents (spread evenly) out of training and write them to "
                           "OUT/heldout, a prepared directory for eval.path (default 0: none)")
    prep.add_argument("--format", choices=("text", "prompt-completion", "preference"), default="text",
                      help="text (default: each file a document, every token a target), prompt-completion "
                           '(supervised fine-tuning: .jsonl files of {"prompt": ..., "completion": ...} lines; only '
                           'completion tokens are targets) or preference (DPO: .jsonl files of {"prompt": ..., '
                           '"chosen": ..., "rejected": ...} lines, each pair two sequences of --seq-len tokens)')
    prep.add_argument("--seq-len", type=int, default=None, metavar="N",
                      help="with --format preference: the job's model.seq_len, every sequence padded or cut to it")
    prep.set_defaults(func=_prepare_data)

    for name, func, text in (("plan", _plan, "show the layout and a per-rank memory estimate"),
                             ("run", _run, "train a job on Ray")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("job", help="job file (YAML)")
        cmd.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                         help="override a job-file field (repeatable)")
        cmd.set_defaults(func=func)
    plan = sub.choices["plan"]
    plan.add_argument("--nodes", type=_positive_int, help="pick a layout for this many nodes (default 1)")
    plan.add_argument("--gpus-per-node", type=_positive_int, help="GPUs per node when picking a layout (default 8)")
    plan.add_argument("--gpu-mem", help="memory per GPU, e.g. 80GB or 80GiB (default: parallel.device_memory, "
                                        "else the GPU type's)")
    plan.add_argument("--noise-scale", type=_positive_int, metavar="N",
                      help="also measure the gradient noise scale (critical batch size, McCandlish et al. 2018) on "
                           "the job's first N global batches, in this process on the CPU")
    plan.add_argument("--gpu", choices=["A100", "H100", "H200", "H800"],  # plan.gpu's (time_model.GPUS)
                      help="GPU type whose peak, memory and bandwidths price the layouts (default: plan.gpu)")
    run = sub.choices["run"]
    run.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    run.add_argument("--summary-json", help="write the run summary here")
    run.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else start a local one)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--id", help="job id for `raymesh attach/stop/status` (default: the `ray job submit` id, "
                                  "else the job name and a hash of its run dir)")
    att = sub.add_parser("attach", help="follow a running job's controller again (progress, events, summary)")
    att.add_argument("id", help="the job id `raymesh run` printed (or the `ray job submit` id)")
    att.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else the local cluster)")
    att.add_argument("--no-progress", action="store_true", help="no progress bar")
    att.add_argument("--summary-json", help="write the run summary here when it ends")
    att.set_defaults(func=_attach)
    exp = sub.add_parser("export-merged", help="fold a LoRA run's adapters into plain model weights (.pt)")
    exp.add_argument("job", help="the LoRA job file the checkpoint was trained with")
    exp.add_argument("--checkpoint", help=CHECKPOINT_HELP)
    exp.add_argument("--out", required=True,
                     help="output .pt file (a GPT state dict; usable as model.lora.base_checkpoint)")
    exp.add_argument("--format", choices=("pt", "hf"), default="pt",
                     help="pt: one .pt state dict; hf: a Hugging Face directory at --out (model.arch: llama)")
    exp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a job-file field")
    exp.set_defaults(func=_export_merged)
    hf = sub.add_parser("export-hf", help="write a checkpoint (any layout) as a Hugging Face directory (llama)")
    hf.add_argument("job", help="the job file the checkpoint was trained with")
    hf.add_argument("--checkpoint", help=CHECKPOINT_HELP)
    hf.add_argument("--out", required=True,
                    help="output directory or object-store URL (config.json + model.safetensors)")
    hf.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a job-file field")
    hf.set_defaults(func=_export_hf)
    add_generate_command(sub)
    rep = sub.add_parser("report", help="PNG charts and an HTML page for a run directory")
    rep.add_argument("run_dir", help="the job's run_dir, a directory or an object-store URL (holds summary.json, "
                                     "steps.jsonl, timeline.jsonl)")
    rep.add_argument("--out", help="output directory or URL (default RUN_DIR/report)")
    rep.add_argument("--step", type=int, help="step to draw the pipeline timeline for (default: the last)")
    rep.set_defaults(func=_report)
    schema = sub.add_parser("schema", help="print the job file's JSON Schema (editors: docs/job.schema.json is a copy)")
    schema.set_defaults(func=_schema)
    add_client_commands(sub)
    _describe_commands(sub)
    return parser


def _describe_commands(sub: argparse._SubParsersAction) -> None:
    """Give each subcommand's ``--help`` its one-line ``help=`` as description: argparse shows that line only in
    ``raymesh --help``'s list, so ``raymesh plan --help`` listed options without saying what ``plan`` does."""
    for action in sub._choices_actions:  # one per add_parser(help=...), named by its command
        command = sub.choices[action.dest]
        command.description = command.description or action.help


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user's mistake (a bad value, a path that is missing or of the wrong kind, a file that is
    not what it should be) is one line naming it and exit 2, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, OSError, ValueError, LookupError) as exc:
        print(f"raymesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # `run` handles its own once a controller exists: here it had not started one
        said = " before the job started; nothing to resume" if args.func is _run else ""
        print(f"raymesh: interrupted{said}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
