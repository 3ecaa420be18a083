"""The worker -> controller records: their JSON form keeps the keys the run records and summary always had."""

from __future__ import annotations

import pickle

from workers.protocol import PHASES, RankInfo, StepResult, StepTimes

BASE_KEYS = ["rank", "step", "loss", "grad_norm", "lr", "tokens", "applied", "time_s", "peak_memory_bytes",
             "current_memory_bytes"]


def result(**extra) -> StepResult:
    times = StepTimes(data=0.1, compute=0.5, bubble=0.2, communication=0.05, optimizer=0.05, step=0.9)
    return StepResult(rank=1, step=3, loss=None, grad_norm=0.7, lr=1e-3, tokens=256, applied=True, time_s=times,
                      peak_memory_bytes=10, current_memory_bytes=5, **extra)


def test_absent_optional_parts_stay_out_of_the_json_form():
    out = result().to_dict()
    assert list(out) == [*BASE_KEYS, "replicated_step"]
    assert list(out["time_s"]) == list(PHASES)


def test_measured_memory_timeline_and_ps_clocks_appear_when_present():
    out = result(memory={"params": 4}, timeline=[{"kind": "F"}], local_steps=2, clock=7).to_dict()
    assert {"memory", "timeline", "local_steps", "clock"} <= set(out)
    assert out["memory"] == {"params": 4} and out["clock"] == 7


def test_records_round_trip_through_their_dict_and_through_pickle():
    r = result(memory={"params": 4}, replicated_step=2)
    assert StepResult.from_dict(r.to_dict()) == r
    assert pickle.loads(pickle.dumps(r)) == r  # what Ray does at the actor boundary
    info = RankInfo(rank=0, coords={"dp": 0, "pp": 1, "tp": 0}, stages=[1], device="cpu", device_name="cpu",
                    pid=42, node_id="n", actor_id="a", extra={"ps_routes": 2})
    assert RankInfo.from_dict(info.to_dict()) == info
    assert info.identity == {"pid": 42, "actor_id": "a", "node_id": "n"}
    assert list(info.to_dict())[:8] == ["rank", "coords", "stages", "device", "device_name", "pid", "node_id",
                                        "actor_id"]
