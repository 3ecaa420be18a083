"""A rank restored from an in-memory snapshot (a rollback, or a replaced rank taking a peer's copy) masks each
replayed step by the documents of the batch that step reads, not the last one read before the restore: the
ids come from the cursor's ``next_batch``, after the restored position. One gloo rank in this process, no Ray."""

from __future__ import annotations

import torch

from tests.support.documents import short_documents
from tests.support.one_rank import one_rank_trainer


def test_a_restored_rank_replays_each_step_under_its_own_batchs_documents(tmp_path_factory):
    from workers.state import snapshot

    data = {"path": str(short_documents(tmp_path_factory.mktemp("documents")))}
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
