"""The driver side of raymesh: job spec, planner, placement, controller, CLI."""

from orchestrator.client import Client
from orchestrator.controller import TrainingJob
from orchestrator.errors import SpecError
from orchestrator.run_result import RunResult
from orchestrator.spec import JobSpec, load_spec

__all__ = ["Client", "JobSpec", "RunResult", "SpecError", "TrainingJob", "load_spec"]
