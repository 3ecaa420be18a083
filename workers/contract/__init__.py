"""What the controller and the ranks share, declared once, torch-free: the bottom layer of ``workers``.

``sections`` declares every field a rank reads, with its type, bounds and default; the driver's
``orchestrator.spec`` subclasses these classes to add the checks that name the fix, and ``workers.spec.WorkerSpec``
parses the dict the controller sends with the same classes. ``fields`` holds the value types both use. The facts
both sides compute from them: the rank grid (``grid``), the pipeline schedule table (``schedules``), gradient
compression's kinds (``compression_kinds``), which 16-bit scheme a rank runs (``mixed_precision``), and one
reducer per figure a step reports (``figures``). Nothing here imports another layer of ``workers``.
"""
