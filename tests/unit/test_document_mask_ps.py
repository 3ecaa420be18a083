"""``parallel.dp_sync: ps`` under ``model.attention_mask: document``: a rank whose gradients go through the
parameter-server shards runs the same masked forward as the plain loop. One gloo rank and one shard served over
gRPC on loopback, both in this process (no Ray); the first step's loss and gradient norm (before any update)
are the single-process reference's, which masks, and not causal attention's."""

from __future__ import annotations

import pytest

from tests.support.documents import short_documents
from tests.support.jobs import tiny_spec
from tests.support.one_rank import one_rank_trainer
from tests.support.reference import reference_run

PS = {"parallel": {"dp_sync": "ps"}, "parameter_server": {"transport": "grpc", "shards": 1}}


@pytest.fixture
def shard_route(tmp_path):
    """One BSP shard of the tiny job on loopback, built as ``PSShards`` builds it, and its route as the ranks get
    it."""
    from parameter_server.shard import PSShard

    job, token = tiny_spec(tmp_path, tmp_path, **PS), "document-mask-test"
    shard = PSShard(0, "bsp", job.parameter_server.server_optim(job.optim), 1, [job.optim.lr] * job.train.steps,
                    job.optim.grad_clip)
    address = shard.serve_grpc(token, host="127.0.0.1")
    yield {"shards": [{"address": address, "token": token}]}
    shard.grpc.server.stop(None)


def test_a_parameter_server_rank_masks_by_document(tmp_path_factory, tmp_path, shard_route):
    model = {"attention_mask": "document", "init_std": 0.1}
    data = short_documents(tmp_path_factory.mktemp("documents"))
    with one_rank_trainer(tmp_path_factory, data={"path": str(data)}, extra={"ps_routes": shard_route}, model=model,
                          **PS) as trainer:
        assert trainer.ps is not None
        first = trainer.train_step()
    masked = reference_run(tiny_spec(data, tmp_path / "masked", model=model), 1)
    causal = reference_run(tiny_spec(data, tmp_path / "causal", model={**model, "attention_mask": "causal"}), 1)
    assert first.loss == pytest.approx(masked[0][0], rel=1e-5)
    assert first.grad_norm == pytest.approx(masked[1][0], rel=1e-5)
    assert first.loss != pytest.approx(causal[0][0], rel=1e-5)
