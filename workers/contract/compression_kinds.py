"""The names of the gradient compression kinds, apart from their hooks (``workers.parallel.grad_compression``).

Torch-free so the job-file checks (``orchestrator.spec``) and the planner can name them without importing torch:
``raymesh status`` or ``raymesh --help`` should not spend seconds loading a tensor library they never use.
"""

KINDS = ("none", "bf16", "fp16", "powersgd", "topk")  # parallel.grad_compression
PS_KINDS = ("none", "bf16", "topk")  # parameter_server.compression (``WireCodec``)
# the kinds whose error feedback is each rank's own (what it held back differs from its peers')
WITH_FEEDBACK = ("powersgd", "topk")
