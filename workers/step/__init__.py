"""The rank's step on seams: step engines, objectives, step hooks and the figures they report.

- ``engine.py``, ``pipeline.py``, ``ps_round.py``: one engine per way of stepping (gradient accumulation, torch's
  pipeline schedules, PipeDream's asynchronous pipeline, asp/ssp parameter-server rounds), chosen once when the
  rank is built (``build_engine``), each ``run(batch, objective) -> (loss, grad_norm, applied)``.
- ``objectives.py``: one ``Objective`` per loss (mean LM, masked LM, DPO), registered by ``train.objective``.
- ``hooks.py``: the per-step features (MoE statistics, evaluation, comm bytes, timeline, memory, data mix, PS
  traffic), each a ``StepHook`` filling its own entry of the result's ``extras``.
- ``figures.py``: one reducer per ``extras`` entry, which the controller folds over the ranks' results.

This ``__init__`` imports nothing: ``figures.py`` is torch-free and the controller imports it without torch.
"""
