"""The rank's own step loop and what it agrees with its peers and the controller at each step boundary.

The controller does not drive steps: it hands every rank a ``Window`` (train up to a step, with the window's
faults, skips and checkpoint plan) and then only supervises. Each rank runs ``RankLoop``: after every step the
ranks reduce their step results up a tree to rank 0 (``tree.TreeExchange``), rank 0 merges them into one record
for the controller and adds the controller's pending requests (stop, a live fault), and the tree carries that
``Boundary`` back down, so every rank acts on the same decision at the same step. Torch-free except
``torch_transport``: the same loop drives virtual ranks in the fake runtime and the scale simulator.
"""
