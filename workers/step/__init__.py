"""The rank's step on seams: step engines, objectives and step hooks.

- ``engine.py``, ``pipeline.py``, ``ps_round.py``: one engine per way of stepping (gradient accumulation, torch's
  pipeline schedules, PipeDream's asynchronous pipeline, asp/ssp parameter-server rounds), chosen once when the
  rank is built (``build.py``: ``build_engine``), each ``run(batch, objective) -> (loss, grad_norm, applied)``.
- ``objectives.py``: one ``Objective`` per loss (mean LM, masked LM, DPO), registered by ``train.objective``.
- ``hooks.py``: the per-step features (MoE statistics, evaluation, comm bytes, timeline, memory, data mix, PS
  traffic), each a ``StepHook`` filling its own entry of the result's ``extras``; one reducer per entry, which the
  controller folds over the ranks' results, is declared with the driver's shared facts
  (``workers.contract.figures``).

This ``__init__`` imports nothing, so importing one module of the package loads no other.
"""
