"""The job-file sections the controller and the ranks share, declared once (torch-free).

``sections`` declares every field a rank reads, with its type, bounds and default; the driver's
``orchestrator.spec`` subclasses these classes to add the checks that name the fix, and ``workers.spec.WorkerSpec``
parses the dict the controller sends with the same classes. ``fields`` holds the value types both use.
"""
