"""A rank restored from an in-memory snapshot (a rollback, or a replaced rank taking a peer's copy) masks each
replayed step by the documents of the batch that step reads, not the last one read before the restore: the
ids come from the cursor's ``next_batch``, after the restored position. One gloo rank in this process, no Ray."""

from __future__ import annotations

import random

import torch

from tests.support.one_rank import one_rank_trainer


def _short_documents(root):
    """Prepared bytes of 200 documents of 3 to 30 letters: most 32-token windows cross a boundary."""
    from workers.data.prepare import prepare_data

    rng, src = random.Random(0), root / "src"
    src.mkdir()
    for i in range(200):
        (src / f"{i:04d}.txt").write_text("".join(rng.choice("abcdefgh ij\n") for _ in range(rng.randint(3, 30))))
    prepare_data([src], root / "tokens")
    return root / "tokens"


def test_a_restored_rank_replays_each_step_under_its_own_batchs_documents(tmp_path_factory):
    from workers.state import snapshot

    data = {"path": str(_short_documents(tmp_path_factory.mktemp("documents")))}
    with one_rank_trainer(tmp_path_factory, data=data, model={"attention_mask": "document"}) as trainer:
        first = snapshot.take(trainer.state)
        clean, documents = [], []
        for _ in range(3):
            clean.append(trainer.train_step().loss)
            documents.append(trainer.state.cursor.documents.clone())
        assert all(d.amax() > 0 for d in documents) and not torch.equal(documents[0], documents[1])
        snapshot.restore(trainer.state, first)
        replayed = []
        for step in range(3):
            replayed.append(trainer.train_step().loss)
            assert torch.equal(trainer.state.cursor.documents, documents[step])
        assert replayed == clean
