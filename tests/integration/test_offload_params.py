"""ZeRO-3 parameter offload (ZeRO-Infinity style).

FSDP2 unit shards kept in the NVMe store give the numbers of no offload.
"""

from __future__ import annotations

from orchestrator.planning.estimate import estimate, render
from tests.support.jobs import tiny_spec
from tests.support.parity_harness import ran, run_grouped, run_spec
from tests.support.probes import peak_memory_probe


def _offload(tmp_path, params: bool) -> dict:
    return {"offload": {"optimizer": True, "params": params, "tier": "nvme", "path": str(tmp_path / "nvme")}}


def test_param_offload_cuts_peak_resident_memory(token_data, tmp_path):
    """Against ZeRO-3 with only the optimizer offloaded, moving the parameter shards to NVMe too keeps the losses
    bit for bit and lowers the peak RSS (fresh processes) by >= 80% of the parameter bytes moved (~55 MB)."""
    big = {"model": {"d_model": 384, "n_layers": 8, "n_heads": 6, "d_ff": 1536, "seq_len": 32},
           "train": {"steps": 3, "global_batch_size": 2, "microbatches": 1}, "parallel": {"zero": 3}}
    base_spec = tiny_spec(token_data, tmp_path, memory=_offload(tmp_path, False), **big)
    base = peak_memory_probe(base_spec, tmp_path / "base.json")
    off_spec = tiny_spec(token_data, tmp_path, memory=_offload(tmp_path, True), **big)
    off = peak_memory_probe(off_spec, tmp_path / "off.json")
    assert off["losses"] == base["losses"]
    moved = off["offloaded_bytes"] - base["offloaded_bytes"]
    assert moved > 50 * 2**20
    saved = base["peak_memory_bytes"] - off["peak_memory_bytes"]
    assert saved >= 0.8 * moved, (saved, moved)


def test_zero3_param_offload_job_matches_and_resumes(ray_cluster, token_data, tmp_path):
    """Real dp=2 ZeRO-3 Ray jobs: parameter + optimizer shards in each rank's NVMe store give the losses and
    gradient norms of plain ZeRO-3, a checkpoint (read from and loaded back into the store) resumes exactly,
    and so does the rollback to an in-memory snapshot when a rank is killed after the resume."""
    from orchestrator import JobSpec, TrainingJob

    par = {"dp": 2, "zero": 3, "device": "cpu"}
    # no offload (harness, a Ray job's bits), stepping PyTorch's fused AdamW, whose kernel the offloaded step runs
    plain = run_spec(tiny_spec(token_data, tmp_path / "a", parallel=par, optim={"implementation": "fused"}))
    memory = _offload(tmp_path, True)
    first = TrainingJob(tiny_spec(token_data, tmp_path / "b", parallel=par, memory=memory, train={"steps": 5},
                                  checkpoint={"every": 5}), progress=False).run()
    assert first.grad_norms == plain.grad_norms[:5]
    raw = tiny_spec(token_data, tmp_path / "b", parallel=par, memory=memory, checkpoint={"memory_every": 1},
                    fault_tolerance={"heartbeat_timeout_s": 30, "collective_timeout_s": 10}).to_dict()
    raw["faults"] = [{"kind": "kill_rank", "rank": 1, "at_step": 8}]
    resumed = TrainingJob(JobSpec.from_dict(raw), resume=True, progress=False).run()
    assert resumed.resumed_from.endswith("step-00000005") and len(resumed.recoveries) == 1
    assert first.losses + resumed.losses == plain.losses
    assert resumed.grad_norms == plain.grad_norms[5:]


def test_param_offload_with_pipeline_and_tensor_parallel_matches(token_data, tmp_path):
    """pp=2 x tp=2 x dp=2 ZeRO-3: each stage's units (TP-sharded DTensors, sharded again over dp) fetched from the
    NVMe store before their all-gather give the losses and gradient norms of the same job without offload. Both
    jobs train on one spawn of 8 rank processes (the Ray-free harness): the offload lives in the ranks, and the
    Ray job above covers it through the controller."""
    par, train = {"dp": 2, "pp": 2, "tp": 2, "zero": 3, "device": "cpu"}, {"steps": 2}
    specs = {"plain": tiny_spec(token_data, tmp_path / "a", parallel=par, train=train),
             "off": tiny_spec(token_data, tmp_path / "b", parallel=par, train=train, memory=_offload(tmp_path, True))}
    runs = run_grouped(specs)
    plain, off = ran(runs, "plain"), ran(runs, "off")
    assert off.losses == plain.losses and off.grad_norms == plain.grad_norms


def test_plan_counts_the_parameter_shard_as_offloaded(token_data, tmp_path):
    """`raymesh plan`: with params offloaded a ZeRO-3 rank keeps no persistent weights, only the gathered units."""
    par = {"dp": 2, "zero": 3, "device": "cpu"}
    opt_only = estimate(tiny_spec(token_data, tmp_path, parallel=par, memory=_offload(tmp_path, False)))[0]
    spec = tiny_spec(token_data, tmp_path, parallel=par, memory=_offload(tmp_path, True))
    both = estimate(spec)[0]
    shard = 4 * both.params // 2
    assert opt_only.state.params == shard and both.state.params == 0
    assert both.state.offloaded == opt_only.state.offloaded + shard
    assert both.state.gathered == opt_only.state.gathered > 0
    assert f"{both.state.offloaded / 2**20:.2f}Mi a rank (parameter shards + optimizer state)" in render(spec)
