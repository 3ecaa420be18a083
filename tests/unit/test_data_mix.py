"""`data.mix`: weighted mixtures of prepared directories, their order, their checks and their records."""

from __future__ import annotations

import math
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from orchestrator.errors import SpecError
from orchestrator.observability.run_records import step_record, summary_fields
from orchestrator.runtime.ray_data import with_ray_dataset
from orchestrator.spec import JobSpec, check_before_start, load_spec
from tests.support.jobs import TINY
from tests.support.one_rank import one_rank_trainer
from tests.support.reference import reference_run
from workers.data import DataCursor, MixedDataset, TokenDataset, blend, prepare_data, write_token_rows
from workers.loop.summary import StepSummary
from workers.protocol import StepResult, StepTimes

SEQ = 8


def _corpus(root: Path, tokens: int, offset: int) -> Path:
    """A prepared byte corpus of about ``tokens`` tokens whose text starts at byte ``offset``."""
    (root / "src").mkdir(parents=True)
    (root / "src" / "text.txt").write_bytes(bytes(i % 90 + offset for i in range(tokens)))
    prepare_data([root / "src"], root / "out", shard_tokens=500)
    return root / "out"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """A large source (~2,500 windows of SEQ + 1) and a small one (~60), so the small one repeats its epochs."""
    return (_corpus(tmp_path_factory.mktemp("big"), 20_000, 32),
            _corpus(tmp_path_factory.mktemp("small"), 500, 40))


def _mix(dirs, weights=(0.7, 0.3)) -> MixedDataset:
    return MixedDataset([(str(d), w) for d, w in zip(dirs, weights)], SEQ, seed=3)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1.0, 2.0, 3.0], [5.0, 0.5], [0.2, 0.2, 0.6]])
def test_blend_counts_stay_within_one_of_the_weights(weights):
    shares = blend.normalised(weights)
    which, _ = blend.take(shares, 0, 5000)
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[which], axis=0)
    n = np.arange(1, 5001)[:, None]
    assert np.abs(counts - shares * n).max() < 1
    for far in (10**9, 10**12 + 7):  # a resume late in a long run: no replay of the choices before it
        assert np.abs(blend.counts(shares, far) - shares * far).max() < 1


def test_weights_near_floats_limit_blend_as_their_ratio(tmp_path, dirs):
    """1e308 + 1e308 overflows to inf: the shares must still be the weights' ratio, in the blend and in the check
    of each source's share of a batch (which refuses the small source's half of a 256-sample batch)."""
    for huge, ratio in [([1e308, 1e308], [1.0, 1.0]), ([1.5e308, 5e307], [3.0, 1.0]), ([1e-320, 1e-320], [1, 1])]:
        shares = blend.normalised(huge)
        assert np.allclose(shares, blend.normalised(ratio))
        assert np.array_equal(blend.take(shares, 0, 50)[0], blend.take(blend.normalised(ratio), 0, 50)[0])
    ordinary = np.array([0.37, 1.9, 4.21])  # their shares fingerprint a checkpoint's position: kept bit for bit
    assert blend.normalised(ordinary.tolist()).tolist() == (ordinary / ordinary.sum()).tolist()
    with pytest.raises(SpecError, match="share 0.5") as err:
        check_before_start(_spec(tmp_path, _entries((dirs[0], 1e308), (dirs[1], 1e308)),
                                 train={"global_batch_size": 256}))
    assert err.value.field == "data.mix[1].path"


def test_blend_far_positions_continue_the_order():
    """The samples taken from position n are what the counts at n and at n + c differ by, at any n; near the start
    they are the same slice of one long take."""
    shares = blend.normalised([1.0, 2.0, 3.0])
    start = 10**12 + 5
    which, index = blend.take(shares, start, 1000)
    assert np.array_equal(blend.counts(shares, start) + np.bincount(which, minlength=3),
                          blend.counts(shares, start + 1000))
    before = blend.counts(shares, start)
    for j in range(3):  # within a source: its next samples in its own stream
        assert np.array_equal(index[which == j], before[j] + np.arange((which == j).sum()))
    whole = blend.take(shares, 0, 3000)
    part = blend.take(shares, 1234, 700)
    assert np.array_equal(part[0], whole[0][1234:1934]) and np.array_equal(part[1], whole[1][1234:1934])


def test_the_order_is_the_same_for_any_dp_size_and_resumes_from_position(dirs):
    mix, gb = _mix(dirs), 16
    one = DataCursor(mix, gb, dp_rank=0, dp_size=1)
    four = [DataCursor(mix, gb, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(30):  # past the small source's epoch (~60 windows at 30%)
        assert np.array_equal(np.concatenate([c.sample_ids_for_step() for c in four]), one.sample_ids_for_step())
        expected = one.next_batch()
        got = [c.next_batch() for c in four]
        assert all(np.array_equal(np.concatenate([g[i] for g in got]), expected[i]) for i in (0, 1))
    resumed = DataCursor(_mix(dirs), 8, dp_rank=1, dp_size=2)  # another batch and layout, the same stream
    resumed.load_state_dict(one.state_dict())
    assert np.array_equal(resumed.sample_ids_for_step(), one.dataset.global_sample_ids(30 * gb + 4, 4))


def test_each_source_keeps_its_own_epochs(dirs):
    """Each source's samples are its own order (the one it has alone), so the small one repeats its epochs while
    the large one is still in its first; a batch's windows are the sources' own windows."""
    mix = _mix(dirs)
    n = 1000
    pairs = mix.global_sample_ids(0, n)
    counts = mix.contributed(n)
    for j, source in enumerate(mix.sources):
        alone = TokenDataset(source.path, SEQ, seed=3)
        assert np.array_equal(pairs[pairs[:, 0] == j, 1], alone.global_sample_ids(0, counts[str(source.path)]))
    big, small = (mix.sources[j].num_samples for j in (0, 1))
    assert counts[str(mix.sources[1].path)] > small and counts[str(mix.sources[0].path)] < big
    inputs, targets = mix.batch(0, 4)
    for row, (j, sample) in enumerate(pairs[:4]):
        window = mix.sources[j].store.read(int(sample) * SEQ, SEQ + 1)
        assert np.array_equal(inputs[row].numpy(), window[:-1]) and np.array_equal(targets[row].numpy(), window[1:])


def test_a_changed_weight_is_refused_on_resume(dirs):
    saved = DataCursor(_mix(dirs), 8, 0, 1, position=80).state_dict()
    with pytest.raises(ValueError, match="data.mix"):
        DataCursor(_mix(dirs, (0.5, 0.5)), 8, 0, 1).load_state_dict(saved)


def _spec(tmp_path: Path, data: dict, **sections) -> JobSpec:
    raw = {k: dict(v) for k, v in TINY.items()}
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    return JobSpec.from_dict({**raw, "data": data, "run_dir": str(tmp_path / "run")})


def _entries(*pairs) -> dict:
    return {"mix": [{"path": str(path), "weight": weight} for path, weight in pairs]}


@pytest.mark.parametrize(("data", "field", "says"), [
    ({"path": "/a", "mix": [{"path": "/b", "weight": 1.0}]}, "data.path", "together with data.mix"),
    ({"mix": [{"path": "/a", "weight": 0.7}, {"path": "/b", "weight": 0.0}]}, "data.mix[1].weight", "greater than 0"),
    ({"mix": [{"path": "/a", "weight": -1.0}]}, "data.mix[0].weight", "greater than 0"),
    ({"mix": [{"path": "/a", "weight": math.inf}]}, "data.mix[0].weight", "finite"),
    ({"mix": [{"path": "/a", "weight": 1.0}, {"path": "/a", "weight": 2.0}]}, "data.mix", "listed twice"),
    ({"mix": [{"path": "s3://b/a", "weight": 1.0}, {"path": "s3://b/a/", "weight": 2.0}]}, "data.mix", "listed twice"),
    ({"seed": 1}, "data.path", "required"),
])
def test_a_bad_mixture_is_refused_naming_the_entry(tmp_path, data, field, says):
    with pytest.raises(SpecError, match=says) as err:
        _spec(tmp_path, data)
    assert err.value.field == field


def test_every_source_passes_the_checks_a_data_path_does(tmp_path, dirs):
    check_before_start(_spec(tmp_path, _entries((dirs[0], 0.7), (dirs[1], 0.3))))
    with pytest.raises(SpecError, match="has no prepared data") as err:
        check_before_start(_spec(tmp_path, _entries((dirs[0], 0.7), (tmp_path / "none", 0.3))))
    assert err.value.field == "data.mix[1].path"
    # the small source's share of a 256-sample batch at seq_len 32 (78 windows) is more than its 500 tokens
    with pytest.raises(SpecError, match="share 0.3") as err:
        check_before_start(_spec(tmp_path, _entries((dirs[0], 0.7), (dirs[1], 0.3)),
                                 train={"global_batch_size": 256}))
    assert err.value.field == "data.mix[1].path" and "lower data.mix[1].weight" in err.value.fix


def test_one_directory_written_two_ways_or_copied_is_refused(tmp_path, dirs):
    """Both entries would draw the same sample ids in the same order: every sample twice in a row."""
    (tmp_path / "link").symlink_to(dirs[0])
    copy = tmp_path / "copy"
    shutil.copytree(dirs[0], copy)
    same = "is the same directory as"
    for twin, says in [(dirs[1] / ".." / ".." / dirs[0].parent.name / dirs[0].name, same),
                       (tmp_path / "link", same), (copy, r"holds a shard \(shard-00000.parquet\) of")]:
        with pytest.raises(SpecError, match=f"{says} data.mix\\[0\\].path {dirs[0]}") as err:
            check_before_start(_spec(tmp_path, _entries((dirs[0], 0.5), (twin, 0.25))))
        assert err.value.field == "data.mix[1].path" and "sum of the two weights (0.5 + 0.25 = 0.75)" in err.value.fix


def test_sources_must_hold_one_tokenizers_ids(tmp_path, dirs):
    ids = tmp_path / "ids"
    write_token_rows([np.arange(3000) % 1000], ids, vocab_size=1000, source="test")
    with pytest.raises(SpecError, match=f"{dirs[0]} holds those of tokenizer bytes") as err:
        check_before_start(_spec(tmp_path, _entries((dirs[0], 0.5), (ids, 0.5)), model={"vocab_size": 1000}))
    assert err.value.field == "data.mix[1].path"
    more = tmp_path / "ids2"
    write_token_rows([(np.arange(3000) + 1) % 1000], more, vocab_size=1000, source="test")
    with pytest.raises(SpecError, match="smaller than the vocabulary") as err:  # model.vocab_size covers each
        check_before_start(_spec(tmp_path, _entries((ids, 0.5), (more, 0.5))))
    assert err.value.field == "model.vocab_size"


def test_eval_path_is_checked_against_every_source(tmp_path, dirs):
    with pytest.raises(SpecError, match=f"data.mix\\[1\\].path {dirs[1]}") as err:
        check_before_start(_spec(tmp_path, _entries((dirs[0], 0.5), (dirs[1], 0.5)),
                                 eval={"path": str(dirs[1]), "every": 2, "batches": 1}))
    assert err.value.field == "eval.path"


def test_relative_mix_paths_resolve_like_data_path(tmp_path, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text("data:\n  mix:\n    - {path: data/a, weight: 2}\n    - {path: s3://b/c, weight: 1}\n")
    monkeypatch.chdir(tmp_path)
    assert load_spec(job).data.sources() == [(str(tmp_path / "data/a"), 2.0), ("s3://b/c", 1.0)]


def test_a_ray_dataset_is_refused_beside_a_mixture(tmp_path, dirs):
    spec = _spec(tmp_path, _entries((dirs[0], 0.5), (dirs[1], 0.5)))
    with pytest.raises(SpecError, match="replaces the job's data") as err:
        with_ray_dataset(spec, dataset=None, resume=False)
    assert err.value.field == "data.mix"


def test_step_records_and_summary_carry_each_sources_count():
    mix = {"/a": 11, "/b": 5}
    results = [StepResult(rank=r, step=2, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=8, applied=True,
                          time_s=StepTimes(step=1.0), peak_memory_bytes=0, current_memory_bytes=0, data_mix=mix)
               for r in range(2)]
    record = step_record(StepSummary.of_all(results), 1.0, 8, 0.0, 0.0)
    assert record["data_mix"] == mix
    assert summary_fields([record])["data_mix"] == mix
    unmixed = StepSummary.of_all([StepResult(**{**results[0].__dict__, "data_mix": None})])
    assert "data_mix" not in step_record(unmixed, 1.0, 8, 0, 0)


def _short_documents(root: Path, offset: int) -> Path:
    """A prepared corpus of 60 short documents (30 to 89 bytes), so most windows of TINY's seq_len cross one."""
    (root / "src").mkdir(parents=True)
    for i in range(60):
        (root / "src" / f"{i:02d}.txt").write_bytes(bytes((i * 7 + j) % 90 + offset for j in range(30 + i)))
    prepare_data([root / "src"], root / "out")
    return root / "out"


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> list[dict]:
    return [{"path": str(_short_documents(tmp_path_factory.mktemp(name), offset)), "weight": weight}
            for name, offset, weight in (("a", 32, 0.75), ("b", 40, 0.25))]


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_a_mixture_trains_as_the_reference_does(tmp_path_factory, short_docs, mask):
    """One rank's Trainer on a mixture (no Ray): finite losses equal to the single-process reference's, and each
    step's result counts the samples each source supplied. Under the document mask the sources' shared
    end-of-document id splits the windows on both sides (the loss then differs from causal attention's)."""
    model = {**TINY["model"], "attention_mask": mask}
    with one_rank_trainer(tmp_path_factory, data={"mix": short_docs}, model=model) as t:
        results = [t.train_step() for _ in range(2)]
    spec = JobSpec.from_dict({**TINY, "model": model, "data": {"mix": short_docs},
                              "run_dir": str(tmp_path_factory.mktemp("r"))})
    losses, _ = reference_run(spec, 2)
    assert all(math.isfinite(r.loss) for r in results)
    assert [r.loss for r in results] == pytest.approx(losses, rel=1e-4)
    assert results[-1].data_mix == {short_docs[0]["path"]: 12, short_docs[1]["path"]: 4}  # 16 samples at 3:1
    if mask == "document":
        causal = JobSpec.from_dict({**spec.to_dict(), "model": TINY["model"]})
        # an untrained model attends almost evenly, so the mask moves the first loss by ~1e-4, far above float noise
        assert abs(reference_run(causal, 1)[0][0] - losses[0]) > 1e-5


def test_run_prepares_a_missing_default_corpus_named_in_a_mixture(tmp_path, dirs, monkeypatch):
    """`raymesh run` prepares `data/stdlib` when a mixture names it, as it does for `data.path`, and the mixture
    then passes the checks."""
    from orchestrator.cli.default_corpus import prepare_default_corpus

    monkeypatch.setattr("workers.data.prepare.default_sources",
                        lambda: [Path(sysconfig.get_paths()["stdlib"]) / "json"])  # the default corpus in small
    spec = _spec(tmp_path, _entries((dirs[0], 0.5), (tmp_path / "data" / "stdlib", 0.5)))
    assert prepare_default_corpus(spec)
    check_before_start(spec)
    assert not prepare_default_corpus(spec)


def test_generate_reads_the_mixtures_tokenizer(tmp_path, dirs):
    from orchestrator.cli.generate import job_tokenizer

    tokenizer = job_tokenizer(_spec(tmp_path, _entries((dirs[0], 0.5), (dirs[1], 0.5))))
    assert tokenizer.decode(tokenizer.encode(b"mix").tolist()) == "mix"
