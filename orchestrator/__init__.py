"""The driver side of raymesh: job spec, planner, placement, controller, CLI."""

from orchestrator.api.client import Client
from orchestrator.errors import SpecError
from orchestrator.runtime.controller import TrainingJob
from orchestrator.runtime.run_result import RunResult
from orchestrator.spec import JobSpec, load_spec

__all__ = ["Client", "JobSpec", "RunResult", "SpecError", "TrainingJob", "load_spec"]
