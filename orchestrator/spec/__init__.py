"""The job file: sections (`model`, `sections`), the whole `JobSpec` with its cross-section checks, loading with
overrides, pydantic errors turned into `SpecError`s that name field, value and fix, and pre-start checks.

Every public name is re-exported here: callers import from `orchestrator.spec`, not from its modules.
"""

from orchestrator.spec.job import JobSpec
from orchestrator.spec.loading import load_spec
from orchestrator.spec.model import ModelSpec
from orchestrator.spec.raw import apply_overrides, parse_override
from orchestrator.spec.runtime_checks import (
    check_before_start,
    check_data_path,
    check_resources,
    check_writable_dir,
)
from orchestrator.spec.sections import (
    CheckpointSpec,
    DataSpec,
    FaultSpec,
    FaultToleranceSpec,
    MemorySpec,
    MetricsSpec,
    OffloadSpec,
    OptimSpec,
    ParallelSpec,
    ParameterServerSpec,
    PrecisionSpec,
    TrainSpec,
)

__all__ = [
    "CheckpointSpec", "DataSpec", "FaultSpec", "FaultToleranceSpec", "JobSpec", "MemorySpec", "MetricsSpec",
    "ModelSpec", "OffloadSpec", "OptimSpec", "ParallelSpec", "ParameterServerSpec", "PrecisionSpec", "TrainSpec",
    "apply_overrides", "check_before_start", "check_data_path", "check_resources", "check_writable_dir", "load_spec",
    "parse_override",
]
