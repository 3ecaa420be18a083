"""deploy/: the KubeRay manifests validate against KubeRay's own CRD schemas (shipped in deploy/crds/, strict
about unknown fields as ``kubectl apply --validate=strict`` is), fit together, and carry a valid raymesh job."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from orchestrator import JobSpec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PRESERVE = "x-kubernetes-preserve-unknown-fields"


def _strict(schema: dict) -> dict:
    """``schema`` refusing fields it does not name (the API server prunes or, validating strictly, refuses them):
    jsonschema alone lets every misspelt field through."""
    if isinstance(schema, dict):
        if "properties" in schema and not schema.get(PRESERVE) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def _validator(crd: str) -> jsonschema.Draft7Validator:
    raw = json.loads(gzip.decompress((DEPLOY / "crds" / f"ray.io_{crd}.v1.schema.json.gz").read_bytes()))
    return jsonschema.Draft7Validator(_strict(raw))


def _docs(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / name).read_text())}


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft7Validator]:
    return {"RayCluster": _validator("rayclusters"), "RayJob": _validator("rayjobs")}


def _errors(validator: jsonschema.Draft7Validator, doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_manifests_validate_against_the_kuberay_crds(validators) -> None:
    for name in ("raycluster.yaml", "rayjob.yaml"):
        for kind, doc in _docs(name).items():
            if kind in validators:
                assert doc["apiVersion"] == "ray.io/v1"
                assert _errors(validators[kind], doc) == [], name


def test_the_strict_schema_refuses_a_misspelt_field_and_a_wrong_type(validators) -> None:
    cluster = _docs("raycluster.yaml")["RayCluster"]
    misspelt = copy.deepcopy(cluster)
    misspelt["spec"]["workerGroupSpecs"][0]["replica"] = 2
    assert any("'replica' was unexpected" in e for e in _errors(validators["RayCluster"], misspelt))
    wrong = copy.deepcopy(cluster)
    wrong["spec"]["authOptions"]["mode"] = "tokens"
    assert any(e.startswith("spec.authOptions.mode") for e in _errors(validators["RayCluster"], wrong))


def test_the_manifests_fit_together_and_carry_a_valid_job() -> None:
    cluster_docs, job = _docs("raycluster.yaml"), _docs("rayjob.yaml")["RayJob"]
    cluster = cluster_docs["RayCluster"]
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    secret = cluster["spec"]["authOptions"]["secretName"]
    submitter_env = job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["env"]
    assert {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "auth_token"}}} \
        in submitter_env
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    jobs_map = next(v["configMap"]["name"] for v in head["volumes"] if v["name"] == "jobs")
    assert jobs_map == cluster_docs["ConfigMap"]["metadata"]["name"]
    job_file = job["spec"]["entrypoint"].split()[2]
    assert job_file.startswith(mounts["jobs"] + "/")
    spec = JobSpec.from_dict(yaml.safe_load(cluster_docs["ConfigMap"]["data"][Path(job_file).name]))
    gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for g in cluster["spec"]["workerGroupSpecs"])
    assert spec.parallel.grid.world_size == gpus  # one rank per GPU the workers offer
    assert spec.resolved_run_dir().is_relative_to(mounts["shared"])  # checkpoints on the shared volume


def test_no_container_overrides_the_nccl_error_handling_that_keeps_survivors() -> None:
    """Each rank sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 unless the environment has it; 1 or 3 would end every
    survivor's process with a lost rank, so a manifest may leave it out or say 2, nothing else."""
    for name in ("raycluster.yaml", "rayjob.yaml"):
        for doc in _docs(name).values():
            for env in _values_named(doc, "env"):
                for var in env:
                    if var.get("name") == "TORCH_NCCL_ASYNC_ERROR_HANDLING":
                        assert var.get("value") == "2", f"{name}: {var}"


def _values_named(node, key: str):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _values_named(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _values_named(item, key)
